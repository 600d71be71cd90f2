"""What a trial's end means: the one rule that the sweep, the report, `confirm`, `transfer` and
warm starts share (a light module: the report imports it without Ray's Tuner or torch).

Each trial of a sweep ends with one status:

    completed      trained its full length
    stopped early  ASHA stopped it at a rung
    cut by budget  the sweep's budget (`sweep.budget`, wall-clock or tokens) ended it
    diverged       its loss became NaN or infinite
    refused        the config refused its sampled values (e.g. heads that do not divide the width)
    error          anything else went wrong: a bug, out of memory, a lost node
    unfinished     running, or interrupted and not yet resumed

Diverged and refused trials say something about their hyperparameters: they are scored with a
bad, finite loss (Optuna COMPLETE with that value), so that TPE learns to avoid their region. An
error says nothing about them: Optuna FAIL, left out of TPE and of warm starts, with its reason.
Trials stopped early or cut by the budget are Optuna PRUNED, valued at their last evaluation.
"""

from __future__ import annotations

import math
from typing import Any

from experiments.objective import METRIC

STATUSES = ("completed", "stopped early", "cut by budget", "diverged", "refused", "error", "unfinished")
RANKED = ("completed", "stopped early", "cut by budget")  # ended without error: a loss to rank
FLAGS = ("error", "diverged", "refused")  # what a trial's last report carries when it went wrong


def ended_status(result: dict[str, Any] | None, full_tokens: float, *, cut: bool = False) -> str:
    """The status of a trial that ended with `result`, its last report (None: it died without
    one). A trial short of its token budget was stopped by ASHA, or by the sweep's budget
    where `cut`."""
    if not result:
        return "error"
    for flag in FLAGS:
        if result.get(flag):
            return flag
    if result.get("tokens", 0) >= full_tokens:
        return "completed"
    return "cut by budget" if cut else "stopped early"


def study_verdict(status: str, result: dict[str, Any]) -> tuple[str, float | None]:
    """The Optuna state (a `TrialState` name) and value that a trial with `status` is told with;
    a PRUNED trial is valued by Optuna at its last intermediate value."""
    if status in ("completed", "diverged", "refused"):
        return "COMPLETE", float(result[METRIC])
    if status in ("stopped early", "cut by budget"):
        return "PRUNED", None
    return "FAIL", None


def ranked(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials with a loss to rank, best first within each group: completed ones, then those
    stopped early, then those cut by the budget (a loss at fewer tokens ranks only among its
    own kind)."""
    ok = [t for t in trials if t["status"] in RANKED and math.isfinite(t["val_loss"])]
    return sorted(ok, key=lambda t: (RANKED.index(t["status"]), t["val_loss"]))


def best_trial(trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest final loss among trials that ended without error; None before any has."""
    ok = [t for t in trials if t["status"] in RANKED and math.isfinite(t["val_loss"])]
    return min(ok, key=lambda t: t["val_loss"]) if ok else None
