"""Hyperparameter importances that say how sure they are.

Optuna's PED-ANOVA, on the trials valued at the common token count (see `common`), asked which
parameters the top quarter of the trials owes its losses to. A handful of trials gives a ranking
anyway, and bars that look decisive: so the importances come with a bootstrap interval (the
evaluation repeated on trials resampled with replacement), and below `MIN_TRIALS` trials none
are drawn at all, only the sentence that says why.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

from experiments.objective import DIRECTION

MIN_TRIALS = 20  # PED-ANOVA wants >= 5 trials in its top quantile (Optuna's docs): 5 / 0.25
TOP_QUANTILE = 0.25  # "what the best quarter of the trials has in common"
RESAMPLES = 100
LEVEL = 0.9  # the interval holds the middle 90% of the resampled importances


@dataclass(frozen=True)
class Importances:
    n_trials: int
    point: dict[str, float]  # importance on all trials, most important first; empty: not ranked
    low: dict[str, float]  # the interval, per parameter
    high: dict[str, float]
    note: str  # what a reader must know: too few trials, overlapping ranks, trials left out


def importances(study: Any, *, resamples: int = RESAMPLES, seed: int = 0) -> Importances:
    """PED-ANOVA importances of `study`'s parameters with bootstrap intervals, or none below
    MIN_TRIALS trials (with the note that says so)."""
    import optuna

    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    n = len(trials)
    if n < MIN_TRIALS:
        return Importances(n, {}, {}, {}, too_few(n))
    point = _evaluate(trials)
    rng = random.Random(seed)
    samples = [_evaluate([rng.choice(trials) for _ in trials]) for _ in range(resamples)]
    tail = (1 - LEVEL) / 2
    # A percentile interval need not hold the estimate on all trials (the resamples repeat some
    # trials and miss others): it is widened to hold it, so that it can be drawn around it.
    low = {k: min(v, _quantile([s.get(k, 0.0) for s in samples], tail)) for k, v in point.items()}
    high = {k: max(v, _quantile([s.get(k, 0.0) for s in samples], 1 - tail)) for k, v in point.items()}
    return Importances(n, point, low, high, _overlap_note(point, low, high, resamples))


def too_few(n: int) -> str:
    """The sentence the report shows instead of importances from `n` < MIN_TRIALS trials."""
    return (
        f"{n} trial{'s' * (n != 1)} compared: too few to rank the hyperparameters. Below "
        f"{MIN_TRIALS} trials (5 in the top quarter) a ranking of their importances cannot be told "
        "apart from noise, so none is drawn; run more trials (sweep.num_samples) to rank them."
    )


def _evaluate(trials: list[Any]) -> dict[str, float]:
    """Normalized PED-ANOVA importances of `trials` (its warnings are the report's note)."""
    import optuna

    study = optuna.create_study(direction=DIRECTION)
    study.add_trials(trials)
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=TOP_QUANTILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.importance.get_param_importances(study, evaluator=evaluator)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _overlap_note(
    point: dict[str, float], low: dict[str, float], high: dict[str, float], resamples: int
) -> str:
    """What the intervals are, and which neighbouring ranks they cannot tell apart."""
    names = list(point)
    tied = [f"{a} and {b}" for a, b in zip(names, names[1:], strict=False) if low[a] <= high[b]]
    note = f"Intervals: the middle {LEVEL:.0%} of the importances on {resamples} resamples of the trials."
    if tied:
        note += f" Overlapping intervals ({', '.join(tied)}): this data cannot tell those ranks apart."
    return note
