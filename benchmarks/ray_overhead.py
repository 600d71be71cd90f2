"""What Ray Train costs: steady-state tokens/s of the quickstart model in a 1-worker Ray Train run
vs the bare in-process loop, measured in the same run, plus Ray's fixed start-up; and 2 DDP workers
x 1 thread vs 1 worker x 2 threads.

    python benchmarks/ray_overhead.py --data data/shakespeare [--steps 80]

Both sides run gptcore's `Trainer.fit` with a report every 10 steps, and both read the same
number: the training-window tokens/s of each report (eval and checkpoint time excluded). Steady
state is the median over the reports after the first. Bare and Ray runs alternate (`--rounds`
pairs) on the same local Ray instance, so both see the same background; a single pair moves by
~10% with the machine's noise, so the ratio printed is the median of the pairs' ratios, with
their range.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from experiments.cluster import ray_session
from experiments.ray_config import RayExperiment, checked_for_workers, load_experiment
from experiments.ray_train import build_trainer
from gptcore.train import Trainer


def config(data: str, steps: int, *overrides: str) -> RayExperiment:
    return checked_for_workers(
        load_experiment(
            "experiments/configs/quickstart.toml",
            [
                f'data.dir="{data}"',
                f"train.max_steps={steps}",
                "train.log_interval=10",
                "train.eval_interval=10",
                "train.eval_tokens=2048",
                "train.keep_checkpoints=0",
                *overrides,
            ],
        )
    )


def steady(reports: list[dict]) -> tuple[float, float]:
    """(tokens/s, MFU): medians over the reports after the first."""
    return (
        statistics.median(m["tokens_per_sec"] for m in reports[1:]),
        statistics.median(m["mfu"] for m in reports[1:]),
    )


def bare_tokens_per_sec(cfg: RayExperiment) -> tuple[float, float]:
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    reports: list[dict] = []
    Trainer(cfg, log=None).fit(lambda metrics, state: reports.append(dict(metrics)))
    return steady(reports)


def ray_tokens_per_sec(cfg: RayExperiment, storage: str, name: str) -> tuple[float, float, float]:
    """(steady tokens/s and MFU from rank 0's reports; seconds of fit() that were not training
    steps: start-up, evaluation, checkpoints, shutdown)."""
    start = time.perf_counter()
    result = build_trainer(cfg, storage=storage, name=name, max_failures=0).fit()
    wall = time.perf_counter() - start
    reports = sorted((m for _, m in result.best_checkpoints), key=lambda m: m["step"])
    steps_per_report = cfg.train.eval_interval
    train_seconds = sum(
        steps_per_report * cfg.train.batch_size * cfg.model.seq_len / m["tokens_per_sec"] for m in reports
    )
    return (*steady(reports), wall - train_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument(
        "--rounds", type=int, default=3, help="bare / Ray Train pairs, alternated (default 3)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    one = config(args.data, args.steps, "resources.cpus_per_worker=2")
    ddp_cfg = config(
        args.data, args.steps, "resources.workers=2", "resources.cpus_per_worker=1", "train.batch_size=8"
    )
    pairs = []
    with ray_session(), tempfile.TemporaryDirectory() as storage:
        for k in range(args.rounds):
            pairs.append((bare_tokens_per_sec(one), ray_tokens_per_sec(one, storage, f"one-{k}")))
        ddp, mfu_ddp, _ = ray_tokens_per_sec(ddp_cfg, storage, "ddp")
    print(
        f"quickstart model, {args.steps} steps, global batch {one.train.batch_size} x "
        f"{one.model.seq_len} tokens, steady state = median of 10-step windows"
    )
    for k, ((bare, mfu_bare), (on_ray, mfu_ray, overhead)) in enumerate(pairs):
        print(
            f"  round {k}: bare loop {bare:6.0f} tokens/s MFU {mfu_bare:.1%} | Ray Train 1 x 2 "
            f"threads {on_ray:6.0f} tokens/s MFU {mfu_ray:.1%} | ratio {on_ray / bare:.3f} | "
            f"{overhead:.1f} s outside steps"
        )
    ratios = sorted(on_ray / bare for (bare, _), (on_ray, _, _) in pairs)
    ray_median = statistics.median(on_ray for _, (on_ray, _, _) in pairs)
    outside_median = statistics.median(overhead for _, (_, _, overhead) in pairs)
    print(
        f"  Ray Train / bare loop, median of {len(pairs)}: {statistics.median(ratios):.3f} "
        f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}; aim >= 0.97)"
    )
    print(
        f"  Ray Train time outside steps, median: {outside_median:.1f} s"
        f" (start-up, {args.steps // 10} evals + checkpoints, shutdown)"
    )
    print(
        f"  Ray Train DDP, 2 workers x 1 thread   {ddp:9.0f} tokens/s  "
        f"MFU {mfu_ddp:.1%} (per 1-thread worker)  ratio vs 1 x 2 threads (median) "
        f"{ddp / ray_median:.3f}"
    )


if __name__ == "__main__":
    main()
