"""Sweep efficiency: the best validation loss that TPE + ASHA, random search and a 3x3x2 grid find
on one fixed tiny task, with how much of the wall-clock x workers was spent in training steps
(utilization), over several seeds per method.

    python benchmarks/sweep_efficiency.py --data data/shakespeare [--trials 18] [--steps 60]
                                          [--seeds 3]
    python benchmarks/sweep_efficiency.py --utilization sweeps/demo     # an existing sweep

Equal compute means equal training tokens: the grid and random search run `--trials` full trials;
TPE + ASHA may start more trials (ASHA stops most early) until a Tune Stopper sees the same total
token count. `tpe+asha/3` is TPE + ASHA given a third of those tokens: does it reach the grid's
best within seed noise in a third of the time? The task is the quickstart recipe shrunk (2
layers, d 64, seq 64). Seed k sets the searcher's seed and the training seed (init, data order)
of every trial, so the spread of a method's best loss over seeds includes both.

Utilization = sum over trials of the time in training steps (tokens / the reported training-window
tokens/s) / (wall-clock x concurrent workers). Each trial's start-up and wind-down, evaluation and
checkpoints are what it leaves out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ray.tune.stopper import Stopper

from experiments.budget import concurrency, trial_tokens
from experiments.cluster import local_resources, ray_session
from experiments.config import RayExperiment, checked_for_workers, load_experiment
from experiments.experiment import start_experiment
from experiments.results import load_analysis, load_trials
from experiments.space import Space, apply_overrides, parse_space
from experiments.tuner import new_tuner, search_config

GRID = {
    "optim.lr": [3e-4, 3e-3, 3e-2],
    "optim.weight_decay": [0.0, 0.017, 0.3],
    "optim.warmup": [0.05, 0.25],
}  # 3 x 3 x 2 over the quickstart's search space


def task(data: str, steps: int, trials: int) -> RayExperiment:
    return checked_for_workers(
        load_experiment(
            "experiments/configs/quickstart.toml",
            [
                f'data.dir="{data}"',
                "model.n_layer=2",
                "model.n_head=2",
                "model.n_kv_head=2",
                "model.d_model=64",
                "model.seq_len=64",
                f"train.max_steps={steps}",
                f"train.eval_interval={steps // 4}",
                "train.eval_tokens=16384",
                "train.log_interval=1000",
                "train.keep_checkpoints=1",
                "sweep.baseline=false",
                'sweep.budget=""',
                f"sweep.num_samples={trials}",
                "sweep.reduction_factor=3",
            ],
        )
    )


class TokenBudget(Stopper):
    """End the whole experiment once its trials have trained `budget` tokens."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.tokens: dict[str, float] = {}

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        self.tokens[trial_id] = result.get("tokens", 0.0)
        return False

    def stop_all(self) -> bool:
        return sum(self.tokens.values()) >= self.budget


def run_method(name: str, cfg: RayExperiment, space: Space, root: Path, width: int) -> dict:
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    exp_dir = root / f"{name.replace('/', '-')}-seed{cfg.sweep.seed}"
    start_experiment(exp_dir, cfg, {"max_concurrent": width})
    param_space, stop = None, None
    if name.startswith("tpe+asha"):
        share = 1 / 3 if name.endswith("/3") else 1.0
        tune_config = search_config(cfg, space, exp_dir)
        tune_config.num_samples = 10 * cfg.sweep.num_samples  # the Stopper ends it first
        stop = TokenBudget(share * cfg.sweep.num_samples * trial_tokens(cfg))
    elif name == "random":
        searcher = OptunaSearch(
            space=space.suggest,
            metric="val_loss",
            mode="min",
            sampler=optuna.samplers.RandomSampler(seed=cfg.sweep.seed),
        )
        tune_config = tune.TuneConfig(search_alg=searcher, num_samples=cfg.sweep.num_samples)
    else:
        param_space = {k: tune.grid_search(v) for k, v in GRID.items()}
        tune_config = tune.TuneConfig()
    start = time.perf_counter()
    new_tuner(cfg, space, exp_dir, width, tune_config=tune_config, param_space=param_space, stop=stop).fit()
    wall = time.perf_counter() - start
    return {"name": name, "wall": wall, **measure(exp_dir, width * cfg.resources.workers, wall)}


def measure(exp_dir: Path, workers: int, wall: float | None = None) -> dict[str, Any]:
    """Best val loss, trials, tokens trained, and utilization of one experiment folder. Without
    `wall`, the wall-clock is the span from the first trial's start to the last report."""
    trials = load_trials(exp_dir)
    frames = load_analysis(exp_dir).trial_dataframes.values()
    train_s, starts, ends = 0.0, [], []
    for frame in frames:
        if "tokens_per_sec" not in frame:  # a trial the budget ended before its first report
            continue
        rows = frame.dropna(subset=["tokens_per_sec"]).sort_values("tokens")
        previous = 0.0
        for tokens, rate in zip(rows["tokens"], rows["tokens_per_sec"], strict=True):
            train_s += (tokens - previous) / rate
            previous = tokens
        starts.append(frame["timestamp"].iloc[0] - frame["time_total_s"].iloc[0])
        ends.append(frame["timestamp"].iloc[-1])
    wall = wall or (max(ends) - min(starts))
    losses = [t["val_loss"] for t in trials if not math.isnan(t["val_loss"])]
    return {
        "best": min(losses) if losses else math.nan,
        "trials": len(trials),
        "tokens": sum(t["tokens"] for t in trials),
        "train_s": train_s,
        "utilization": train_s / (wall * workers),
        "span": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--trials", type=int, default=18, help="full trials of grid / random")
    parser.add_argument("--steps", type=int, default=60, help="steps per full trial")
    parser.add_argument("--methods", default="tpe+asha,tpe+asha/3,random,grid")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each method (seeds 0..N-1)")
    parser.add_argument(
        "--utilization",
        metavar="EXPERIMENT_DIR",
        default=None,
        help="only measure the utilization of an existing sweep",
    )
    args = parser.parse_args()
    if args.utilization:
        exp_dir = Path(args.utilization).resolve()
        cfg = load_experiment(exp_dir / "gptrun.toml")
        width = json.loads((exp_dir / "sweep.json").read_text())["max_concurrent"]
        m = measure(exp_dir, width * cfg.resources.workers)
        print(
            f"{exp_dir.name}: {m['trials']} trials, {width} at a time, wall {m['span']:.0f} s "
            f"(first trial start to last report), {m['train_s']:.0f} s in training steps: "
            f"utilization {m['utilization']:.1%}"
        )
        return
    base = task(args.data, args.steps, args.trials)
    space = parse_space(base)
    width = concurrency(base, *local_resources())
    names = args.methods.split(",")
    print(
        f"task: quickstart shrunk to 2 layers, d 64, seq 64; {args.steps} steps = "
        f"{trial_tokens(base):,} tokens per full trial; budget {args.trials} full trials = "
        f"{args.trials * trial_tokens(base):,} tokens; {width} trials at a time; "
        f"seeds {list(range(args.seeds))}"
    )
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with ray_session(), tempfile.TemporaryDirectory() as root:
        for seed in range(args.seeds):  # seeds outermost: a drift in machine load hits all methods
            cfg = apply_overrides(base, {"sweep.seed": seed, "train.seed": base.train.seed + seed})
            for name in names:
                r = run_method(name, cfg, space, Path(root), width)
                runs[name].append(r)
                print(
                    f"  seed {seed} {name}: best {r['best']:.4f}, {r['trials']} trials, "
                    f"{r['wall']:.0f} s, utilization {r['utilization']:.1%}",
                    flush=True,
                )
    print(
        f"{'method':>10}  {'best val loss (mean +- std)':>27}  {'trials':>6}  {'tokens':>10}  "
        f"{'wall s':>7}  {'utilization':>11}"
    )
    for name, rs in runs.items():
        best = [r["best"] for r in rs]
        print(
            f"{name:>10}  {statistics.fmean(best):18.4f} +- {_std(best):.4f}  "
            f"{statistics.fmean(r['trials'] for r in rs):6.1f}  "
            f"{statistics.fmean(r['tokens'] for r in rs):10,.0f}  "
            f"{statistics.fmean(r['wall'] for r in rs):7.0f}  "
            f"{statistics.fmean(r['utilization'] for r in rs):11.1%}"
        )
    if "grid" in runs:
        grid = runs["grid"]
        for name, rs in runs.items():
            if name == "grid":
                continue
            gap = statistics.fmean(r["best"] for r in rs) - statistics.fmean(r["best"] for r in grid)
            walls = statistics.fmean(r["wall"] for r in rs) / statistics.fmean(r["wall"] for r in grid)
            print(
                f"{name} vs grid: {gap:+.4f} nats (seed std {_std([r['best'] for r in rs]):.4f}"
                f" vs {_std([r['best'] for r in grid]):.4f}), {walls:.2f}x the wall-clock"
            )


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


if __name__ == "__main__":
    main()
