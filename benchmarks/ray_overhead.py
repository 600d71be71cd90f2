"""What Ray Train costs: steady-state tokens/s of the quickstart model in a 1-worker Ray Train run
vs the bare in-process loop, measured in the same run, plus Ray's fixed start-up; and 2 DDP workers
x 1 thread vs 1 worker x 2 threads.

    python benchmarks/ray_overhead.py --data data/shakespeare [--steps 60]

Steady state = the median tokens/s of the log intervals after the first (which holds warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from experiments.train import build_trainer, checked_for_workers
from gptcore.config import load_config
from gptcore.train import Trainer


def config(data: str, steps: int, *overrides: str):
    return checked_for_workers(load_config("experiments/configs/quickstart.toml", [
        f'data.dir="{data}"', f"train.max_steps={steps}", "train.log_interval=10",
        f"train.eval_interval={steps}", "train.eval_tokens=8192", *overrides]))


def local_tokens_per_sec(cfg) -> float:
    import torch

    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    trainer = Trainer(cfg, log=None)
    rates, start = [], time.perf_counter()
    for step in range(1, cfg.train.max_steps + 1):
        trainer.train_step()
        if step % cfg.train.log_interval == 0:
            now = time.perf_counter()
            rates.append(cfg.train.log_interval * trainer.tokens_per_step / (now - start))
            start = now
    return statistics.median(rates[1:])


def ray_tokens_per_sec(cfg, storage: str, name: str) -> tuple[float, float]:
    """(tokens/s of the last log interval, as rank 0 reported it; seconds of fit() that were
    not training: start-up, evaluation, checkpoints, shutdown)."""
    start = time.perf_counter()
    result = build_trainer(cfg, storage=storage, name=name, max_failures=0).fit()
    wall = time.perf_counter() - start
    train_seconds = result.metrics["tokens"] / result.metrics["tokens_per_sec"]
    return result.metrics["tokens_per_sec"], wall - train_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error")
    with tempfile.TemporaryDirectory() as storage:
        one = config(args.data, args.steps, "resources.cpus_per_worker=2")
        bare = local_tokens_per_sec(one)
        on_ray, startup = ray_tokens_per_sec(one, storage, "one")
        ddp_cfg = config(args.data, args.steps, "resources.workers=2",
                         "resources.cpus_per_worker=1", "train.batch_size=8")
        ddp, _ = ray_tokens_per_sec(ddp_cfg, storage, "ddp")
    ray.shutdown()
    print(f"quickstart model, {args.steps} steps, global batch {one.train.batch_size} x "
          f"{one.model.seq_len} tokens")
    print(f"  bare loop (--local, 2 threads)        {bare:9.0f} tokens/s")
    print(f"  Ray Train, 1 worker x 2 threads       {on_ray:9.0f} tokens/s  "
          f"ratio {on_ray / bare:.3f}  (aim >= 0.97)")
    print(f"  Ray Train fixed start-up + eval        {startup:9.1f} s")
    print(f"  Ray Train DDP, 2 workers x 1 thread   {ddp:9.0f} tokens/s  "
          f"ratio vs 1 x 2 threads {ddp / on_ray:.3f}")


if __name__ == "__main__":
    main()
