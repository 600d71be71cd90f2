"""The noise figures of `gptrun confirm` and how they read: each candidate's re-runs, the Welch
test between the best two, the noise fraction, and the sentences and table that the terminal and
the report print. Pure statistics on trial records (scipy): `gptrun report` shows them without
importing the Tuner, Ray Train or torch, which `gptrun confirm` needs to run the re-runs."""

from __future__ import annotations

import math
import statistics
from typing import Any

from experiments.results import fmt_value, short_params
from experiments.table import print_columns

ALPHA = 0.05
NOISE_FILE = "noise.json"  # EXPERIMENT/noise.json, written by `gptrun confirm`


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
