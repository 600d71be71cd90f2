"""How far apart are two fresh runs of one config, compiled and eager? The train loss of every
step, in full precision, from runs that each start in a new process (as a rerun or a resumed run
does), with the same seed, data and batches.

Eager CPU runs are expected to agree bit for bit; compiled ones only to float noise (inductor's
kernels reduce in another order from one fresh compile to the next). The baseline is the eager
pair: the script prints the largest relative difference of a step's loss within each pair, and
between the first compiled and the first eager run.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/compile_drift.py [--config experiments/configs/quickstart.toml] [--steps 50]
                                       [--set train.precision=fp32 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def child(config: str, overrides: list[str]) -> None:
    """Train in this process and print the loss of every step as JSON."""
    from experiments.ray_config import load_experiment
    from gptcore.train import Trainer

    trainer = Trainer(load_experiment(config, overrides), log=None)
    losses: list[float] = []
    step = trainer.train_step

    def recording() -> dict:
        metrics = step()
        losses.append(float(metrics["loss"]))  # a device tensor: a host sync, fine for a record
        return metrics

    trainer.train_step = recording
    trainer.fit()
    print(json.dumps(losses))


def fresh_run(config: str, overrides: list[str], env: dict[str, str]) -> list[float]:
    args = [sys.executable, __file__, "--child", "--config", config]
    for override in overrides:
        args += ["--set", override]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def max_relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/configs/quickstart.toml")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.config, args.overrides)
        return
    with tempfile.TemporaryDirectory(prefix="compile-drift-") as scratch:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor")}
        runs = {}
        for arm in ("true", "false"):
            overrides = [
                *args.overrides,
                f"train.max_steps={args.steps}",
                f"train.eval_interval={args.steps}",
                f"train.compile={arm}",
                f'train.out="{os.path.join(scratch, arm)}"',
            ]
            runs[arm] = [fresh_run(args.config, overrides, env) for _ in range(2)]
    compiled, eager = runs["true"], runs["false"]
    print(f"{args.steps} steps of {args.config} {' '.join(args.overrides)}")
    print(f"two fresh compiled runs: train loss differs by up to {max_relative(*compiled):.2e} (relative)")
    print(f"two fresh eager runs:    train loss differs by up to {max_relative(*eager):.2e} (relative)")
    print(f"compiled vs eager:       train loss differs by up to {max_relative(compiled[0], eager[0]):.2e}")


if __name__ == "__main__":
    main()
