"""`gptrun confirm`: how much of a sweep's spread is seed noise.

A sweep runs every config once, with one seed, so its winner is partly luck: the best of N noisy
draws. Confirm re-runs the K best trials (completed ones first, see `ranked_trials`) with S new
seeds (`train.seed + 1 .. + S`, new weight init and data order) at full budget, as a Tune
experiment in `EXPERIMENT/confirm/` (a grid over candidate x seed; killed, it resumes like a
sweep), and writes `EXPERIMENT/noise.json`:

- each candidate's losses, mean and std over the new seeds (the sweep's own run is left out: it
  was selected for being low);
- a Welch two-sample t-test between the best mean and the runner-up, and a verdict at alpha 0.05;
- the noise fraction: the seed variance (pooled within configs over the re-runs) over the variance
  of the final losses of the sweep's completed trials, the spread the user saw in its table (all at
  full budget; trials stopped early or cut by the budget are left out, their losses are at fewer
  tokens). Near 1, the sweep's differences are mostly seed noise; near 0, the config matters much
  more than the seed. The t-test answers the narrower question about the top two.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import remote
from experiments.autoscale import room_for
from experiments.budget import local_extra_cpus, trial_bundles
from experiments.cluster import ray_session
from experiments.config import RayExperiment, load_experiment
from experiments.experiment import open_experiment, remove_experiment, save, start_experiment
from experiments.results import fmt_value, load_trials, short_params
from experiments.space import parse_space
from experiments.table import print_columns
from experiments.tuner import new_tuner, restore_tuner
from gptcore.errors import UserError

ALPHA = 0.05
CONFIRM_DIR, NOISE_FILE = "confirm", "noise.json"


@dataclass(frozen=True)
class Candidates:
    """What a confirm trial's Tune config means: `candidate` (a sweep trial id) names the config
    values to re-run, `train.seed` the new seed. The `Space` of a confirm experiment."""

    values: dict[str, dict[str, Any]]  # sweep trial id -> its config values

    keys = ("candidate", "train.seed")

    def overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**self.values[config["candidate"]], "train.seed": config["train.seed"]}


def confirm_cli(experiment_dir: str, *, top: int, seeds: int, address: str | None, restart: bool) -> int:
    exp_dir = open_experiment(experiment_dir)
    cfg = load_experiment(exp_dir / "gptrun.toml") if (exp_dir / "gptrun.toml").exists() else None
    if cfg is None:
        raise UserError(
            f"{exp_dir} is not a gptrun sweep folder (no gptrun.toml); pass the "
            "folder that `gptrun sweep` printed"
        )
    if top < 1 or seeds < 2:
        raise UserError(
            f"--top {top} --seeds {seeds}: need --top >= 1 and --seeds >= 2 (a spread needs two runs)"
        )
    plan = confirm_plan(exp_dir, cfg, top, seeds)  # before Ray starts: bad input, no Ray
    _can_restore(exp_dir / CONFIRM_DIR, plan, restart)  # a different plan without --restart
    with ray_session(address, extra_local_cpus=local_extra_cpus(cfg)):
        return confirm(exp_dir, cfg, plan, restart=restart)


def confirm_plan(exp_dir: Path, cfg: RayExperiment, top: int, seeds: int) -> dict[str, Any]:
    """The candidates (the `top` best trials) and the new seeds."""
    ranked = ranked_trials(load_trials(exp_dir))
    if not ranked:
        raise UserError(
            f"{exp_dir} has no trial that finished without error; finish the sweep "
            f"first (`gptrun resume {exp_dir}`)"
        )
    if len(ranked) < top:
        print(f"note: only {len(ranked)} trials finished; confirming those, not {top}")
    return {
        "candidates": [t["trial_id"] for t in ranked[:top]],
        "seeds": [cfg.train.seed + i for i in range(1, seeds + 1)],
    }


def ranked_trials(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed trials by loss, then the ones ASHA stopped early by loss (their loss is at fewer
    tokens, so it only ranks them among themselves); errors and diverged runs are left out."""
    return [
        t
        for status in ("completed", "stopped early", "cut by budget")
        for t in trials
        if t["status"] == status
    ]


def confirm(exp_dir: Path, cfg: RayExperiment, plan: dict[str, Any], *, restart: bool) -> int:
    """Run (or resume) the confirm experiment inside a Ray session; write and print the noise.
    An earlier confirm that is not resumed is deleted only once the cluster has answered."""
    sweep_trials = load_trials(exp_dir)
    space = parse_space(cfg)
    by_id = {t["trial_id"]: t for t in sweep_trials}
    candidates = Candidates({tid: space.overrides(by_id[tid]["config"]) for tid in plan["candidates"]})
    conf_dir = exp_dir / CONFIRM_DIR
    meta = json.loads((exp_dir / "sweep.json").read_text())
    width = meta["max_concurrent"]
    restore = _can_restore(conf_dir, plan, restart)
    n_runs = len(plan["candidates"]) * len(plan["seeds"])
    print(
        f"confirm {conf_dir}: {len(plan['candidates'])} configs x seeds {plan['seeds']} = "
        f"{n_runs} runs at full budget{' (resuming)' if restore else ''}"
    )
    with room_for(trial_bundles(cfg), width, "one run", None):
        if not restore:
            remove_experiment(conf_dir)  # --restart, or killed before Tune saved anything
            start_experiment(conf_dir, cfg, {**meta, **plan})
        _confirm_tuner(cfg, candidates, conf_dir, width, plan, restore, exp_dir.name).fit()
    noise = measure_noise(sweep_trials, load_trials(conf_dir), plan)
    save(exp_dir, NOISE_FILE, json.dumps(noise, indent=1))
    print_noise(noise)
    print(f"noise written to {exp_dir / NOISE_FILE}")
    return 0


def _confirm_tuner(
    cfg: RayExperiment,
    candidates: Candidates,
    conf_dir: Path,
    width: int,
    plan: dict[str, Any],
    restore: bool,
    name: str,
) -> Any:
    """The confirm experiment's Tuner: a grid over candidate x seed, or the interrupted one."""
    from ray import tune

    if restore:
        return restore_tuner(cfg, candidates, conf_dir)
    return new_tuner(
        cfg,
        candidates,
        conf_dir,
        width,
        tune_config=tune.TuneConfig(),
        param_space={
            "candidate": tune.grid_search(plan["candidates"]),
            "train.seed": tune.grid_search(plan["seeds"]),
        },
        tracking_name=f"{name}-confirm",
    )


def _can_restore(conf_dir: Path, plan: dict[str, Any], restart: bool) -> bool:
    """True to resume an earlier confirm of the same plan; a different plan needs --restart.
    Deletes nothing (`confirm` does, once the cluster has answered)."""
    from ray import tune

    if not conf_dir.exists():
        return False
    saved = json.loads((conf_dir / "sweep.json").read_text()) if (conf_dir / "sweep.json").exists() else {}
    same = {k: saved.get(k) for k in plan} == plan
    if same and not restart and tune.Tuner.can_restore(remote.location(conf_dir)):
        return True
    if not same and not restart and saved:
        raise UserError(
            f"{conf_dir} holds a confirm of {len(saved['candidates'])} configs x "
            f"{len(saved['seeds'])} seeds; rerun with those, or pass --restart to "
            "replace it"
        )
    return False


def measure_noise(
    sweep_trials: list[dict[str, Any]], confirm_trials: list[dict[str, Any]], plan: dict[str, Any]
) -> dict[str, Any]:
    """Per-candidate mean +- std over its completed re-runs, best vs runner-up, and the noise
    fraction: pooled seed variance (each config's variance weighted by its n - 1) over the
    variance of the sweep's completed trials' final losses."""
    by_id = {t["trial_id"]: t for t in sweep_trials}
    rows = []
    for tid in plan["candidates"]:
        runs = sorted(
            (t for t in confirm_trials if t["config"]["candidate"] == tid and t["status"] == "completed"),
            key=lambda t: t["config"]["train.seed"],
        )
        losses = [t["val_loss"] for t in runs]
        rows.append(
            {
                "trial_id": tid,
                "params": short_params(by_id[tid]["config"]),
                "sweep_val_loss": by_id[tid]["val_loss"],
                "seeds": [t["config"]["train.seed"] for t in runs],
                "losses": losses,
                "mean": statistics.fmean(losses) if losses else math.nan,
                "std": statistics.stdev(losses) if len(losses) >= 2 else math.nan,
            }
        )
    rows.sort(key=lambda r: (math.isnan(r["mean"]), r["mean"]))
    measured = [r for r in rows if len(r["losses"]) >= 2]
    dof = sum(len(r["losses"]) - 1 for r in measured)
    seed_var = sum((len(r["losses"]) - 1) * r["std"] ** 2 for r in measured) / dof if dof else math.nan
    finals = [
        t["val_loss"] for t in sweep_trials if t["status"] == "completed" and math.isfinite(t["val_loss"])
    ]
    sweep_var = statistics.variance(finals) if len(finals) >= 2 else math.nan
    return {
        "alpha": ALPHA,
        "candidates": rows,
        "seed_std": math.sqrt(seed_var),
        "sweep_std": math.sqrt(sweep_var),
        "sweep_completed": len(finals),
        "noise_fraction": seed_var / sweep_var if sweep_var > 0 else math.nan,
        "comparison": compare(measured),
    }


def compare(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Welch's t-test, best mean vs runner-up: is the winner separated from the noise?"""
    if len(rows) < 2:
        return None
    from scipy.stats import ttest_ind

    best, runner_up = rows[0], rows[1]
    if best["std"] == 0 and runner_up["std"] == 0:  # identical runs: no spread to test against
        p = 0.0 if best["mean"] != runner_up["mean"] else 1.0
    else:
        p = float(ttest_ind(best["losses"], runner_up["losses"], equal_var=False).pvalue)
    return {
        "best": best["trial_id"],
        "runner_up": runner_up["trial_id"],
        "difference": runner_up["mean"] - best["mean"],
        "p_value": p,
        "separated": p < ALPHA,
    }


def verdict(noise: dict[str, Any]) -> str:
    """One sentence: does the best config really win?"""
    cmp = noise["comparison"]
    if cmp is None:
        return "fewer than two configs were re-run, so the winner was not compared"
    head = (
        f"best {cmp['best']} vs runner-up {cmp['runner_up']}: {cmp['difference']:.4f} nats "
        f"apart, Welch p = {cmp['p_value']:.3g}"
    )
    if cmp["separated"]:
        return f"{head} < {noise['alpha']}: the best is separated from the runner-up"
    return f"{head} >= {noise['alpha']}: the difference is within seed noise"


def noise_line(noise: dict[str, Any]) -> str:
    """One sentence: the seed noise and its share of the sweep's spread (terminal and report)."""
    if math.isnan(noise["seed_std"]):
        return "seed noise: not measured (no config has two completed re-runs)"
    head = f"seed noise: std {noise['seed_std']:.4f} nats (pooled over the re-runs)"
    if math.isnan(noise["noise_fraction"]):
        return (
            f"{head}; not compared with the sweep: its {noise['sweep_completed']} completed "
            "trial(s) show no spread"
        )
    return (
        f"{head}, {noise['noise_fraction']:.0%} of the variance between the sweep's "
        f"{noise['sweep_completed']} completed trials (std {noise['sweep_std']:.4f}): "
        "near 100% their differences are mostly noise"
    )


def print_noise(noise: dict[str, Any]) -> None:
    """The re-runs as a table (best mean first), the verdict and the noise line."""
    keys = sorted({k for r in noise["candidates"] for k in r["params"]})
    header = ["#", "trial", *keys, "sweep loss", "mean", "std", "runs"]
    print_columns(
        header,
        [
            [
                str(i),
                r["trial_id"],
                *(fmt_value(r["params"].get(k, "")) for k in keys),
                f"{r['sweep_val_loss']:.4f}",
                f"{r['mean']:.4f}",
                f"{r['std']:.4f}",
                str(len(r["losses"])),
            ]
            for i, r in enumerate(noise["candidates"], 1)
        ],
    )
    print(verdict(noise))
    print(noise_line(noise))
