"""Is `gptrun scale`'s forecast worth anything? Fit a series, forecast a budget `--factor` times
its largest (4 by default: a run the fit never saw), then train at that budget both the
forecast's size and the size Chinchilla's rule of 20 tokens per parameter picks, and compare.

    gptrun prepare --corpus python-stdlib --out data/stdlib-2k --vocab-size 2048
    python benchmarks/scaling_check.py experiments/configs/scale-series.toml [--factor 4]

Every step is the CLI a user runs: `gptrun scale CONFIG` (a killed check resumes the series),
`gptrun scale SERIES --predict --flops C`, then `gptrun train CFG --local` for the two sizes, side
by side (one process each, one thread each). Prints the forecast's loss and interval against the
actual final loss, and the two sizes' actual losses. The targets (issue 35): the actual loss
inside the forecast's 90% interval and within 0.05 nats of it, and the forecast's size better
than the rule's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.ray_config import load_experiment
from experiments.scale import candidate_sizes, forecast_stem, open_series, run_config

GPTRUN = [sys.executable, "-m", "experiments"]


def gptrun(*args: str) -> None:
    print("$ gptrun " + " ".join(args), flush=True)
    subprocess.run([*GPTRUN, *args], check=True)


def final_loss(out: Path) -> float:
    """The last validation loss a `--local` run wrote to its metrics.jsonl."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["val_loss"]


def train_side_by_side(configs: dict[str, Path], series: Path) -> dict[str, float]:
    """`gptrun train --local` of each config at once, each in its own folder; their final losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = {name: series / f"check-{name}" for name in configs}
    procs = {
        name: subprocess.Popen(
            [*GPTRUN, "train", str(cfg), "--local", "--set", f'train.out="{outs[name]}"'],
            env=env,
            stdout=open(series / f"check-{name}.log", "w"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
        )
        for name, cfg in configs.items()
    }
    for name, proc in procs.items():
        if proc.wait() != 0:
            sys.exit(f"the {name} run failed: see {series / f'check-{name}.log'}")
    return {name: final_loss(out) for name, out in outs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="a config with a [scale] table")
    parser.add_argument("--name", default=None, help="the series' name (default: the config's)")
    parser.add_argument("--storage", default="series", help="where the series lives (default ./series)")
    parser.add_argument("--factor", type=float, default=4.0, help="the checked budget over the largest")
    args = parser.parse_args()

    started = time.monotonic()
    name = args.name or load_experiment(args.config).name
    gptrun("scale", args.config, "--name", name, "--storage", args.storage)
    series_s = time.monotonic() - started
    cfg, series, results = open_series(f"{args.storage}/{name}")
    flops = args.factor * max(r["flops"] for r in results)
    gptrun("scale", str(series), "--predict", "--flops", f"{flops:g}")
    forecast = json.loads((series / f"{forecast_stem(flops)}.json").read_text())
    widths = {n: w for w, n, _ in candidate_sizes(cfg, [r["width"] for r in results])}
    configs = {}
    for arm, params, tokens in (
        ("forecast", forecast["params"], forecast["tokens"]),
        ("rule", forecast["rule_params"], forecast["rule_tokens"]),
    ):
        path = series / f"check-{arm}.toml"
        path.write_text(run_config(cfg, widths[params], tokens).to_toml())
        configs[arm] = path
    check_started = time.monotonic()
    actual = train_side_by_side(configs, series)
    check_s = time.monotonic() - check_started

    predicted, low, high = (forecast["loss"][k] for k in ("value", "low", "high"))
    got, rule = actual["forecast"], actual["rule"]
    n, d, rule_n = forecast["params"], forecast["tokens"], forecast["rule_params"]
    print(f"\nbudget {flops:.3g} FLOPs = {args.factor:g} x the series' largest")
    print(f"forecast: d_model={widths[n]}, N={n:,.0f}, D={d:,.0f}")
    print(
        f"  loss predicted {predicted:.4f} ({forecast['level']:.0%}: {low:.4f}-{high:.4f}), actual {got:.4f}"
    )
    print(f"  inside the interval: {low <= got <= high}; error {got - predicted:+.4f} (target: within 0.05)")
    print(f"rule (20 tokens/param): d_model={widths[rule_n]}, N={rule_n:,.0f}, actual {rule:.4f}")
    print(f"  the forecast's size better: {got < rule} ({rule - got:+.4f} nats)")
    print(f"wall-clock: series {series_s:.0f} s (with fits), check runs {check_s:.0f} s")
    if not math.isfinite(got):
        sys.exit(1)


if __name__ == "__main__":
    main()
