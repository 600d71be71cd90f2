"""Does bf16 train as well as fp32? The quickstart trained under both, 3 seeds each, compared.

bf16 autocast is only worth its speed if the model it trains is as good: this trains the quickstart
config in-process (gptcore's Trainer, no Ray) under fp32 and bf16 for each seed, the two
precisions alternating so that machine-load drift hits both alike, and prints per-seed final
validation loss, mean +- std per precision, training tokens/s per precision (the median of the
training windows the trainer reports; evaluation excluded) and the Welch test `gptrun confirm`
uses (experiments.noise.compare) on the two sets of losses.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/precision_quality.py [--config experiments/configs/quickstart.toml]
                                           [--seeds 1337,1338,1339] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from experiments.noise import ALPHA, compare, verdict
from experiments.ray_config import load_experiment
from gptcore.train import Trainer

PRECISIONS = ("fp32", "bf16")


def train_once(config: str, overrides: list[str], seed: int, precision: str, out: str) -> dict[str, float]:
    """One run to the config's budget; its final val loss, median window tokens/s and wall time."""
    cfg = load_experiment(
        config, [*overrides, f"train.seed={seed}", f'train.precision="{precision}"', f'train.out="{out}"']
    )
    trainer = Trainer(cfg, log=None)
    windows: list[float] = []
    start = time.perf_counter()
    result = trainer.fit(lambda metrics, _state: windows.append(metrics["tokens_per_sec"]))
    return {
        "val_loss": result["val_loss"],
        "tokens_per_sec": statistics.median(windows),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/configs/quickstart.toml")
    parser.add_argument("--seeds", default="1337,1338,1339", help="comma-separated training seeds")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PRECISIONS}
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds:
            for precision in PRECISIONS:
                run = train_once(args.config, args.overrides, seed, precision, out)
                runs[precision].append(run)
                print(
                    f"seed {seed} {precision}: val loss {run['val_loss']:.4f}, "
                    f"{run['tokens_per_sec']:,.0f} tok/s, {run['seconds']:.0f} s",
                    flush=True,
                )

    rows = []
    print(
        f"\n{'precision':<10}"
        + "".join(f"{'seed ' + str(s):>12}" for s in seeds)
        + f"{'mean +- std':>20}{'tok/s':>9}"
    )
    for precision, done in runs.items():
        losses = [r["val_loss"] for r in done]
        row = {
            "trial_id": precision,
            "losses": losses,
            "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) >= 2 else float("nan"),
        }
        rows.append(row)
        tok_s = statistics.median(r["tokens_per_sec"] for r in done)
        print(
            f"{precision:<10}"
            + "".join(f"{x:>12.4f}" for x in losses)
            + f"{row['mean']:>11.4f} +- {row['std']:.4f}{tok_s:>9,.0f}"
        )
    speed = statistics.median(r["tokens_per_sec"] for r in runs["bf16"]) / statistics.median(
        r["tokens_per_sec"] for r in runs["fp32"]
    )
    print(f"bf16 / fp32 tokens/s: {speed:.3f}x")
    rows.sort(key=lambda r: r["mean"])
    print(verdict({"comparison": compare(rows), "alpha": ALPHA}))


if __name__ == "__main__":
    main()
