"""Sweep efficiency: the best validation loss that each search finds on one fixed tiny task at
equal training tokens, K trials at a time, over several seeds; how much of the wall-clock x
workers was spent in training steps (utilization); and how soon a warm-started sweep reaches what
a cold one found.

    python benchmarks/sweep_efficiency.py --data data/shakespeare --concurrency 2,8 --seeds 5
    python benchmarks/sweep_efficiency.py --utilization sweeps/demo     # an existing sweep

Every method gets the training tokens of `--trials` full trials:
- grid: 3x3x2 over lr, weight decay and warmup, 18 full trials;
- random: Optuna's RandomSampler, `--trials` full trials;
- plain-tpe+asha: Optuna's plain TPE (`sweep.multivariate = false`, `sweep.constant_liar =
  false`: one model per parameter, no account of running trials; Optuna 4's defaults) + ASHA;
- tpe+asha: what `gptrun sweep` runs (multivariate, constant liar, group) + ASHA;
- warm-tpe+asha: tpe+asha warm-started (`sweep.warm_start`) from the tpe+asha sweep of the
  previous seed at the same K (seed 0 from the last seed's, run after the other seeds): every
  COMPLETE and PRUNED trial of that sweep, with losses measured under that seed's training seed.
The TPE methods start trials until their token budget (a `SweepBudget`) is used up; ASHA (reduction
factor 3) stops most of them early. Grid and random search run at the first K only: they do not
adapt, so each of their trials trains the same config with the same seed at any K (one torch
thread per trial either way), and the later K's tables compare against those runs.

The task is the quickstart recipe shrunk (2 layers, d 64, seq 64); at K trials at a time each
trial gets CPUs/K (one torch thread), so K = 8 on 2 cores runs 8 trial processes at 0.25 CPU
each. Seed k sets the searcher's seed and the training seed (init, data order) of every trial, so
the spread of a method's best loss over seeds includes both.

Printed per K: best val loss mean +- std per method, its gap to random with Welch's p-value (the
test `gptrun confirm` uses), trials, tokens, wall-clock and utilization; and for the warm start,
the share of its token budget spent before it matched the cold tpe+asha sweep's best at the same
seed (the target is at most a half), beside the share at which the cold sweep found it.

Utilization = sum over trials of the time in training steps (tokens / the reported training-window
tokens/s) / (wall-clock x concurrent workers). Each trial's start-up and wind-down, evaluation and
checkpoints are what it leaves out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.cluster import local_resources, ray_session
from experiments.experiment import start_experiment
from experiments.ray_config import RayExperiment, SweepLimit, checked_for_workers, load_experiment
from experiments.results import load_analysis, load_trials
from experiments.sizing import concurrency, trial_tokens
from experiments.space import Space, apply_overrides, parse_space
from experiments.tuner import new_tuner, search_config
from experiments.warm_start import load_history

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


TPE = {
    "plain-tpe+asha": {"sweep.multivariate": False, "sweep.constant_liar": False},
    "tpe+asha": {},  # gptrun sweep's defaults
    "warm-tpe+asha": {},  # and sweep.warm_start, set per run
}
METHODS = ("grid", "random", "plain-tpe+asha", "tpe+asha", "warm-tpe+asha")
NON_ADAPTIVE = ("grid", "random")  # full trials of fixed configs: the same losses at any K


def at_concurrency(base: RayExperiment, k: int, seed: int) -> RayExperiment:
    """The task with K trials at a time sharing this machine's CPUs, searcher and training seeded."""
    cpus, _ = local_resources()
    return apply_overrides(
        base,
        {
            "resources.cpus_per_worker": cpus / k,
            "sweep.max_concurrent": k,
            "sweep.seed": seed,
            "train.seed": base.train.seed + seed,
        },
    )


def run_method(
    name: str, cfg: RayExperiment, space: Space, root: Path, warm_from: Path | None = None
) -> dict:
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    width = concurrency(cfg, *local_resources())
    exp_dir = root / f"{name}-k{width}-seed{cfg.sweep.seed}"
    param_space, budget, history = None, None, None
    if name in TPE:
        cfg = apply_overrides(cfg, TPE[name])
        if warm_from is not None:
            cfg = apply_overrides(cfg, {"sweep.warm_start": str(warm_from)})
            history = load_history(cfg, space, root)
        start_experiment(exp_dir, cfg, {"max_concurrent": width})
        tune_config = search_config(cfg, space, exp_dir, history)
        tune_config.num_samples = 10 * cfg.sweep.num_samples  # the token budget ends it first
        budget = SweepLimit(cfg.sweep.num_samples * trial_tokens(cfg), tokens=True)
    elif name == "random":
        start_experiment(exp_dir, cfg, {"max_concurrent": width})
        searcher = OptunaSearch(
            space=space.suggest,
            metric="val_loss",
            mode="min",
            sampler=optuna.samplers.RandomSampler(seed=cfg.sweep.seed),
        )
        tune_config = tune.TuneConfig(search_alg=searcher, num_samples=cfg.sweep.num_samples)
    else:
        start_experiment(exp_dir, cfg, {"max_concurrent": width})
        param_space = {k: tune.grid_search(v) for k, v in GRID.items()}
        tune_config = tune.TuneConfig()
    start = time.perf_counter()
    new_tuner(
        cfg, space, exp_dir, width, tune_config=tune_config, param_space=param_space, budget=budget
    ).fit()
    wall = time.perf_counter() - start
    return {
        "name": name,
        "dir": exp_dir,
        "wall": wall,
        "history": len(history.trials) if history else 0,
        "progress": progress(exp_dir),
        **measure(exp_dir, width * cfg.resources.workers, wall),
    }


def progress(exp_dir: Path) -> list[tuple[float, float]]:
    """(tokens the whole sweep had trained, val loss) at every report, in the order reported."""
    frames = load_analysis(exp_dir).trial_dataframes.values()
    reports = []
    for frame in frames:
        if "val_loss" not in frame:
            continue
        previous = 0.0
        for rec in frame.sort_values("tokens").to_dict("records"):
            if rec.get("error") == 1.0 or rec.get("diverged") == 1.0 or math.isnan(rec["val_loss"]):
                continue
            reports.append(
                (rec.get("report_unix", rec["timestamp"]), rec["tokens"] - previous, rec["val_loss"])
            )
            previous = rec["tokens"]
    total, out = 0.0, []
    for _, tokens, loss in sorted(reports):
        total += tokens
        out.append((total, loss))
    return out


def tokens_to(target: float, steps: list[tuple[float, float]]) -> float:
    """The sweep's tokens when a report first matched `target` (NaN if none did)."""
    return next((tokens for tokens, loss in steps if loss <= target + 1e-12), math.nan)


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
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", type=int, default=3, help="runs of each method (seeds 0..N-1)")
    parser.add_argument(
        "--concurrency", default="2", help="trials at a time, comma-separated, e.g. 2,8 (default 2)"
    )
    parser.add_argument(
        "--utilization",
        metavar="EXPERIMENT_DIR",
        default=None,
        help="only measure the utilization of an existing sweep",
    )
    args = parser.parse_args()
    if args.utilization:
        print_utilization(Path(args.utilization).resolve())
        return
    base = task(args.data, args.steps, args.trials)
    space = parse_space(base)
    names = args.methods.split(",")
    levels = [int(k) for k in args.concurrency.split(",")]
    budget = args.trials * trial_tokens(base)
    print(
        f"task: quickstart shrunk to 2 layers, d 64, seq 64; {args.steps} steps = "
        f"{trial_tokens(base):,} tokens per full trial; budget {args.trials} full trials = "
        f"{budget:,} tokens; {levels} trials at a time on {local_resources()[0]:g} CPUs; "
        f"seeds {list(range(args.seeds))}; {load()}",
        flush=True,
    )
    started = time.perf_counter()
    shared: dict[str, list[dict]] = {}  # grid and random, run at the first K only
    with ray_session(), tempfile.TemporaryDirectory() as folder:
        for k in levels:
            root = Path(folder) / f"k{k}"
            runs = run_level(k, base, space, [n for n in names if n not in shared], args.seeds, root)
            if shared:
                print(
                    f"{' and '.join(shared)} at K={k}: the K={levels[0]} runs (they do not adapt: each "
                    "of their trials trains the same config, seed and steps at any K; wall-clock and "
                    f"utilization are K={levels[0]}'s)"
                )
            shared = {**{n: runs[n] for n in NON_ADAPTIVE if n in runs}, **shared}
            summarize(k, {**{n: shared[n] for n in names if n in shared}, **runs}, budget)
    print(f"all done in {(time.perf_counter() - started) / 60:.1f} min; {load()}")


def run_level(k: int, base: RayExperiment, space: Space, names: list[str], seeds: int, root: Path) -> dict:
    """Every method at every seed, K at a time. Seeds outermost, so that a drift in machine load
    hits all methods; a warm start runs after the seed whose tpe+asha sweep it starts from."""
    runs: dict[str, dict[int, dict]] = {name: {} for name in names}
    warm = "warm-tpe+asha" in names and "tpe+asha" in names and seeds > 1

    def run(name: str, seed: int, warm_from: Path | None = None) -> None:
        r = run_method(name, at_concurrency(base, k, seed), space, root, warm_from)
        runs[name][seed] = r
        source = f", from {r['history']} trials of seed {(seed - 1) % seeds}" if warm_from else ""
        print(
            f"  K={k} seed {seed} {name}: best {r['best']:.4f}, {r['trials']} trials{source}, "
            f"{r['wall']:.0f} s, utilization {r['utilization']:.1%}; {load()}",
            flush=True,
        )

    for seed in range(seeds):
        for name in names:
            if name != "warm-tpe+asha":
                run(name, seed)
        if warm and seed > 0:
            run("warm-tpe+asha", seed, runs["tpe+asha"][seed - 1]["dir"])
    if warm:
        run("warm-tpe+asha", 0, runs["tpe+asha"][seeds - 1]["dir"])
    return {name: [by_seed[s] for s in sorted(by_seed)] for name, by_seed in runs.items() if by_seed}


def summarize(k: int, runs: dict[str, list[dict]], budget: int) -> None:
    """The table of one concurrency, the gaps to random, and the warm start's tokens to target."""
    from experiments.confirm import compare

    print(f"K = {k} trials at a time, {len(next(iter(runs.values())))} seeds:")
    print(
        f"{'method':>14}  {'best val loss (mean +- std)':>27}  {'vs random':>9}  {'Welch p':>7}  "
        f"{'trials':>6}  {'tokens':>10}  {'wall s':>7}  {'utilization':>11}"
    )
    rows = {name: _row(name, rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        gap, p = "", ""
        if "random" in rows and name != "random":
            cmp = compare([rows[name], rows["random"]])
            gap, p = f"{rows[name]['mean'] - rows['random']['mean']:+.4f}", f"{cmp['p_value']:.3g}"
        print(
            f"{name:>14}  {rows[name]['mean']:18.4f} +- {rows[name]['std']:.4f}  {gap:>9}  {p:>7}  "
            f"{statistics.fmean(r['trials'] for r in rs):6.1f}  "
            f"{statistics.fmean(r['tokens'] for r in rs):10,.0f}  "
            f"{statistics.fmean(r['wall'] for r in rs):7.0f}  "
            f"{statistics.fmean(r['utilization'] for r in rs):11.1%}"
        )
    if "plain-tpe+asha" in rows and "tpe+asha" in rows:
        cmp = compare([rows["tpe+asha"], rows["plain-tpe+asha"]])
        print(
            f"tpe+asha vs plain-tpe+asha: {rows['tpe+asha']['mean'] - rows['plain-tpe+asha']['mean']:+.4f}"
            f" nats, Welch p {cmp['p_value']:.3g}"
        )
    if "warm-tpe+asha" in runs and "tpe+asha" in runs:
        cold, warm = runs["tpe+asha"], runs["warm-tpe+asha"]
        found = [tokens_to(c["best"], c["progress"]) / budget for c in cold]
        reached = [tokens_to(c["best"], w["progress"]) / budget for c, w in zip(cold, warm, strict=True)]
        print(
            "warm start, share of the token budget spent before matching the cold tpe+asha best of "
            f"its seed: {_shares(reached)}; the cold sweep found that best at {_shares(found)}"
        )


def _row(name: str, rs: list[dict]) -> dict[str, Any]:
    """A method as `experiments.confirm.compare` takes a candidate: its best losses over seeds."""
    best = [r["best"] for r in rs]
    return {"trial_id": name, "losses": best, "mean": statistics.fmean(best), "std": _std(best)}


def _shares(values: list[float]) -> str:
    shown = ", ".join("never" if math.isnan(v) else f"{v:.0%}" for v in values)
    met = [v for v in values if not math.isnan(v)]
    median = f"median {statistics.median(met):.0%} of {len(met)} that got there" if met else "none got there"
    return f"{shown} ({median}; {sum(v <= 0.5 for v in met)} of {len(values)} within half)"


def print_utilization(exp_dir: Path) -> None:
    cfg = load_experiment(exp_dir / "gptrun.toml")
    width = json.loads((exp_dir / "sweep.json").read_text())["max_concurrent"]
    m = measure(exp_dir, width * cfg.resources.workers)
    print(
        f"{exp_dir.name}: {m['trials']} trials, {width} at a time, wall {m['span']:.0f} s "
        f"(first trial start to last report), {m['train_s']:.0f} s in training steps: "
        f"utilization {m['utilization']:.1%}"
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} (1 / 5 min)"


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


if __name__ == "__main__":
    main()
