"""Comparisons at a common token count: what the report puts side by side on one loss axis.

ASHA stops the worse trials at its rungs and lets the better ones train on, so the trials' final
losses come after different amounts of training: on one axis they credit training length to the
hyperparameters (a trial with 3x the tokens looks 0.3 nats better whatever its lr). Every plot and
column that compares trials uses instead each trial's validation loss at one token count, by
default the largest that all compared trials reached (ASHA's first rung when it stopped some);
the completed trials' final losses are shown beside it as their own series.

`common_tokens` is the rule, a pure function of the trials and their curves; `analysis_study`
holds the compared trials as an in-memory Optuna study (valued at the common token count) for
Optuna's importances, contour and parallel coordinates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from experiments.objective import DIRECTION
from experiments.outcome import RANKED
from experiments.space import Space
from experiments.table import fmt_tokens


@dataclass(frozen=True)
class CommonTokens:
    tokens: int  # the token count trials are compared at (0: no compared trial has evaluated yet)
    losses: dict[str, float]  # trial id -> its val loss at `tokens`, for every trial compared
    left_out: tuple[str, ...]  # finished trials with no evaluation by `tokens` (failed before one)

    @property
    def label(self) -> str:
        """The loss axis: 'val loss at 102k tokens'."""
        return f"val loss at {fmt_tokens(self.tokens)} tokens"

    @property
    def title(self) -> str:
        """What a plot compares: 'val loss at 102k tokens, 6 trials'."""
        return f"{self.label}, {len(self.losses)} trial{'s' * (len(self.losses) != 1)}"


def common_tokens(
    trials: list[dict[str, Any]], curves: list[dict[str, Any]], tokens: int | None = None
) -> CommonTokens:
    """Each trial's val loss at `tokens` (default: the largest token count every trial that
    finished without error reached), from its last evaluation at or before it.

    Compared: the trials that finished without error, and the unfinished ones that already went
    past that count (a running sweep shows where it is). Diverged and failed trials have no loss
    to compare. A compared trial that never reached it, or has no evaluation at or before
    it (one that ended before its first), is left out and named in `left_out`."""
    points_of = evaluations(curves)
    finished = [t["trial_id"] for t in trials if t["status"] in RANKED]
    if tokens is None:
        tokens = min((points_of[tid][-1][0] for tid in finished if tid in points_of), default=0)
    losses = {}
    for t in trials:
        points = points_of.get(t["trial_id"], [])
        if t["status"] not in (*RANKED, "unfinished") or not points or points[-1][0] < tokens:
            continue
        before = [loss for at, loss in points if at <= tokens]
        if before:
            losses[t["trial_id"]] = before[-1]
    return CommonTokens(tokens, losses, tuple(tid for tid in finished if tid not in losses))


def evaluations(curves: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """trial id -> its (tokens, val loss) evaluations in token order (finite losses only)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in curves:
        tokens, loss = row["tokens"], row["val_loss"]
        if finite(tokens) and finite(loss):
            out.setdefault(row["trial_id"], []).append((int(tokens), float(loss)))
    return {tid: sorted(points) for tid, points in out.items()}


def completed(trials: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The completed trials (their final losses: a series of their own) and the token count
    they end at, as the plots write it."""
    done = [t for t in trials if t["status"] == "completed" and finite(t["val_loss"])]
    return done, fmt_tokens(max((t["tokens"] for t in done), default=0))


def analysis_study(common: CommonTokens, trials: list[dict[str, Any]], space: Space) -> Any:
    """The compared trials as an in-memory Optuna study, each COMPLETE with its loss at the
    common token count, named as the report names them (`lr`, not `optim.lr`). A key searched with
    `include_zero` is two parameters, as in the sweep's own study: `weight_decay=0` (a choice)
    and `weight_decay` (absent when that choice was 0)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=DIRECTION, study_name=common.label)
    for t in trials:
        if t["trial_id"] in common.losses:
            params, distributions = _params(space, t["config"])
            study.add_trial(
                optuna.trial.create_trial(
                    params=params,
                    distributions=distributions,
                    value=common.losses[t["trial_id"]],
                    user_attrs={"trial_id": t["trial_id"], "status": t["status"]},
                )
            )
    return study


def param_name(key: str) -> str:
    """`optim.lr` -> `lr`: the name a parameter has in the report's tables and plots."""
    return key.rpartition(".")[2]


def _params(space: Space, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    params: dict[str, Any] = {}
    distributions: dict[str, Any] = {}
    for p in space.params:
        name = param_name(p.key)
        if p.include_zero:
            params[f"{name}=0"] = bool(config.get(p.zero_flag))
            distributions[f"{name}=0"] = CategoricalDistribution((False, True))
            if params[f"{name}=0"]:
                continue
        if p.key not in config:
            continue
        if p.kind == "choice":
            distributions[name] = CategoricalDistribution(p.choices)
        elif p.kind == "int":
            distributions[name] = IntDistribution(int(p.low), int(p.high))
        else:
            distributions[name] = FloatDistribution(p.low, p.high, log=p.kind == "loguniform")
        params[name] = int(config[p.key]) if p.kind == "int" else config[p.key]
    return params, distributions


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
