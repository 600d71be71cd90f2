"""Scaling-law fits to `gptrun scale`'s miniseries, and the forecast of a bigger run.

Two fits from Hoffmann et al. 2022 (Chinchilla, arXiv 2203.15556). Approach 2 reads the compute-optimal
size off each budget's IsoFLOP profile and fits power laws to those optima. Approach 3 fits
L(N, D) = E + A / N^alpha + B / D^beta to every run, the way Besiroglu et al. 2024 (arXiv 2404.10102)
redid it: Huber loss on log-loss, L-BFGS-B from a grid of starts. Their uncertainty comes from
bootstrapping the runs. Pure numpy and scipy: `gptrun scale` fits without Ray or torch. The results are
dataclasses of floats, lists and dicts, so `dataclasses.asdict` gives what fits.json holds."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TypeVar

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber

from gptcore.errors import UserError

SAME_BUDGET = 0.01  # relative: a budget's runs round their tokens to whole steps, so their flops differ a bit
HUBER_DELTA = 1e-3  # on log-loss, as Besiroglu et al.: below it residuals count squared, above linearly
TOKENS_PER_PARAM = 20.0  # Chinchilla's rule of thumb, printed for comparison
# Approach 3's starts: Besiroglu et al.'s grid of 4500, scored in one vectorized pass; L-BFGS-B starts from
# each (alpha, beta) pair's best point, 25 starts where they minimize from all 4500.
EXPONENTS = (0.0, 0.5, 1.0, 1.5, 2.0)
LOG_COEFS = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
LOG_E = (-1.0, -0.5, 0.0, 0.5, 1.0)
SCOUT_STEPS, FINALISTS = 10, 3  # every start takes SCOUT_STEPS; the FINALISTS best go on to the end
BOUNDS = [(None, None)] * 3 + [(0.0, 3.0)] * 2  # (log A, log B, log E, alpha, beta)

T = TypeVar("T")


@dataclass(frozen=True)
class Run:
    """One finished run of a series."""

    params: float  # N: counted as the caller documents (`gptrun scale`: the matmul params, lm_head included)
    tokens: float  # D
    flops: float  # C = flops_per_token(N) * D, the budget it was trained at
    loss: float  # final validation loss (nats)


@dataclass(frozen=True)
class Profile:
    """One budget's IsoFLOP profile: the vertex of the parabola of loss against log N."""

    flops: float
    sizes: int  # distinct N at this budget
    params: float  # N*(C); the best run's N where the profile has no minimum to read
    tokens: float  # D*(C), from this budget's own line of log D against log N (not C = 6ND)
    loss: float
    flag: str = ""  # why the power laws leave this profile out; empty when they use it


@dataclass(frozen=True)
class IsoFlopFit:
    """Approach 2: N*(C) = k_n * C**a and D*(C) = k_d * C**b, least squares in log-log."""

    profiles: list[Profile]
    a: float
    k_n: float
    b: float
    k_d: float

    def params(self, flops: float) -> float:
        return self.k_n * flops**self.a

    def tokens(self, flops: float) -> float:
        return self.k_d * flops**self.b


@dataclass(frozen=True)
class LossFit:
    """Approach 3: L(N, D) = E + A / N**alpha + B / D**beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    residuals: list[float]  # log(observed) - log(fitted), per run as given

    def loss(self, params: float | np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta


def _fmt(x: float, digits: int = 3) -> str:
    """The one number format the terminal gets: `digits` significant, k/M/B/T up to trillions."""
    x = float(f"{x:.{digits}g}")  # round first, so 999999 reads 1M and not 1e+03k
    group = int(math.log10(abs(x)) // 3) if x and math.isfinite(x) else 0
    return f"{x / 1000**group:.{digits}g}{'kMBT'[group - 1]}" if 1 <= group <= 4 else f"{x:.{digits}g}"


def _checked(runs: Sequence[Run]) -> list[Run]:
    for i, run in enumerate(runs):
        if not all(math.isfinite(v) and v > 0 for v in (run.params, run.tokens, run.flops, run.loss)):
            raise UserError(
                f"run {i} has params={run.params:g} tokens={run.tokens:g} flops={run.flops:g} "
                f"loss={run.loss:g}: a scaling-law fit needs all four positive and finite; drop or rerun it"
            )
    return list(runs)


def _budgets(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped by budget, smallest first: a run within SAME_BUDGET of a group's first joins it."""
    groups: list[list[Run]] = []
    for run in sorted(runs, key=lambda r: r.flops):
        if groups and run.flops <= groups[-1][0].flops * (1 + SAME_BUDGET):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _profile(runs: list[Run]) -> Profile:
    flops = float(np.mean([r.flops for r in runs]))
    logn, logd = np.log([r.params for r in runs]), np.log([r.tokens for r in runs])
    losses = np.array([r.loss for r in runs])
    sizes = len({r.params for r in runs})
    c2, c1, c0 = np.polyfit(logn, losses, 2) if sizes >= 3 else (0.0, 0.0, 0.0)
    if c2 <= 0:  # no minimum to read: the best run stands in, flagged
        best = runs[int(np.argmin(losses))]
        why = f"only {sizes} sizes" if sizes < 3 else "the loss against log N has no minimum"
        return Profile(flops, sizes, best.params, best.tokens, best.loss, f"{why}; add sizes")
    x = -c1 / (2 * c2)
    slope, intercept = np.polyfit(logn, logd, 1)
    flag = ""
    if not logn.min() <= x <= logn.max():
        side = "smaller" if x < logn.min() else "larger"
        flag = (
            f"its minimum lies outside the sizes tried ({_fmt(math.exp(logn.min()))}-"
            f"{_fmt(math.exp(logn.max()))} params); add a {side} size"
        )
    return Profile(flops, sizes, math.exp(x), math.exp(slope * x + intercept), c0 + c1 * x + c2 * x * x, flag)


def _isoflop(groups: list[list[Run]]) -> IsoFlopFit:
    profiles = [_profile(g) for g in groups]
    used = [p for p in profiles if not p.flag]
    if len(used) < 2:
        raise UserError(
            f"only {len(used)} of {len(profiles)} compute budgets have a loss minimum inside their sizes, "
            "and a power law needs 2: add sizes around each budget's best"
        )
    logc = np.log([p.flops for p in used])
    a, log_kn = np.polyfit(logc, np.log([p.params for p in used]), 1)
    b, log_kd = np.polyfit(logc, np.log([p.tokens for p in used]), 1)
    return IsoFlopFit(profiles, float(a), math.exp(log_kn), float(b), math.exp(log_kd))


def fit_isoflop(runs: Sequence[Run]) -> IsoFlopFit:
    """Approach 2: per budget, N*(C) at the vertex of loss against log N; then power laws in C over
    the budgets whose vertex lies inside their sizes (the others are kept, flagged, and left out)."""
    groups = _budgets(_checked(runs))
    if len(groups) < 2:
        raise UserError(f"the runs span {len(groups)} compute budget: IsoFLOP profiles need 2 or more")
    for group in groups:
        if (sizes := len({r.params for r in group})) < 3:
            raise UserError(
                f"the budget of {_fmt(group[0].flops)} FLOPs has {sizes} distinct sizes: an IsoFLOP "
                "profile needs 3 or more; train more sizes at it"
            )
    return _isoflop(groups)


def _terms(theta: np.ndarray, logn: np.ndarray, logd: np.ndarray) -> tuple[np.ndarray, ...]:
    """log A - alpha log N, log B - beta log D and log E: the log-loss is their logsumexp, which stays
    finite for any parameters. theta is (a, b, e, alpha, beta), or a (starts, 5) array of them."""
    a, b, e, alpha, beta = theta.T[..., None]
    return a - alpha * logn, b - beta * logd, e


def _log_loss(terms: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.logaddexp(np.logaddexp(terms[0], terms[1]), terms[2])


def _shift(theta: np.ndarray, logn: float, logd: float) -> np.ndarray:
    """The same law for log N, log D measured from (logn, logd): log A - alpha logn, log B - beta logd."""
    theta = np.array(theta, dtype=float)
    theta[..., 0] -= theta[..., 3] * logn
    theta[..., 1] -= theta[..., 4] * logd
    return theta


def _objective(theta, logn, logd, logl) -> tuple[float, np.ndarray]:
    """Sum of Huber(delta) of the log-loss residuals with its gradient, in units of delta: the same
    minimizer, and a scale at which L-BFGS-B's relative stopping test does not stop at the start."""
    terms = _terms(theta, logn, logd)
    fitted = _log_loss(terms)
    u = (fitted - logl) / HUBER_DELTA
    slope = np.minimum(np.maximum(u, -1), 1) / HUBER_DELTA
    dterms = [slope * np.exp(t - fitted) for t in terms]
    grad = [dterms[0].sum(), dterms[1].sum(), dterms[2].sum(), -dterms[0] @ logn, -dterms[1] @ logd]
    return float(huber(1.0, u).sum()), np.array(grad)


def _grid_starts(logn, logd, logl) -> np.ndarray:
    """Per (alpha, beta) of the grid, the grid's best (log A, log B, log E) for it: 25 starts."""
    pairs = len(EXPONENTS) ** 2
    grid = np.array(list(product(EXPONENTS, EXPONENTS, LOG_COEFS, LOG_COEFS, LOG_E)))[:, [2, 3, 4, 0, 1]]
    u = (_log_loss(_terms(grid, logn, logd)) - logl) / HUBER_DELTA
    best = huber(1.0, u).sum(-1).reshape(pairs, -1).argmin(1)
    return grid.reshape(pairs, -1, 5)[np.arange(pairs), best]


def fit_loss(runs: Sequence[Run], start: LossFit | None = None) -> LossFit:
    """Approach 3: the best of L-BFGS-B from the grid of starts, or from `start` alone (the
    bootstrap's refits, whose minimum lies near the full fit's)."""
    runs = _checked(runs)
    sizes, counts = len({r.params for r in runs}), len({r.tokens for r in runs})
    if len(runs) < 5 or sizes < 2 or counts < 2:
        raise UserError(
            f"fitting L(N, D) needs 5 or more runs at 2 or more sizes and 2 or more token counts; "
            f"got {len(runs)} runs, {sizes} sizes, {counts} token counts"
        )
    logn, logd, logl = (np.log([getattr(r, k) for r in runs]) for k in ("params", "tokens", "loss"))
    # Minimized with log N and log D centred: log A and alpha (log B and beta) then move independently,
    # and L-BFGS-B takes a third fewer steps.
    centre = logn.mean(), logd.mean()
    args = (logn - centre[0], logd - centre[1], logl)

    def descend(x0: np.ndarray, steps: int | None = None):
        options = {"maxiter": steps} if steps else None
        return minimize(_objective, x0, args, "L-BFGS-B", True, bounds=BOUNDS, options=options)

    if start:
        finalists = _shift(
            [math.log(start.A), math.log(start.B), math.log(start.E), start.alpha, start.beta], *centre
        )[None]
    else:
        # Every start takes a few steps and the best few go on: on Chinchilla-like series, the same
        # minimum as taking every start to the end, in a quarter to a half of the steps.
        scouts = sorted(
            (descend(x0, SCOUT_STEPS) for x0 in _shift(_grid_starts(logn, logd, logl), *centre)),
            key=lambda f: f.fun,
        )
        finalists = [f.x for f in scouts[:FINALISTS]]
    fits = [descend(x0) for x0 in finalists]
    theta = _shift(min(fits, key=lambda f: f.fun).x, -centre[0], -centre[1])
    residuals = logl - _log_loss(_terms(theta, logn, logd))
    a, b, e, alpha, beta = theta.tolist()
    return LossFit(math.exp(e), math.exp(a), math.exp(b), alpha, beta, residuals.tolist())


def _bootstrap(fit: Callable[[list[Run]], T], groups: list[list[Run]], resamples: int, rng) -> list[T]:
    """`fit` on each resample, which draws every group's runs with replacement (each group keeps its
    count); a resample the fit rejects (too few distinct sizes or minima left) is skipped."""
    fits = []
    for _ in range(resamples):
        sample = [g[i] for g in groups for i in rng.integers(len(g), size=len(g))]
        try:
            fits.append(fit(sample))
        except UserError:
            continue
    return fits


@dataclass(frozen=True)
class Estimate:
    """A value and the central interval of its bootstrap distribution."""

    value: float
    low: float
    high: float

    def text(self, level: float, digits: int = 3) -> str:
        low, high = (_fmt(v, digits) for v in (self.low, self.high))
        return f"{_fmt(self.value, digits)} ({level:.0%}: {low}-{high})"


@dataclass(frozen=True)
class Forecast:
    """What the fits say of one run at `flops`; each interval is the bootstrap's central `level`."""

    flops: float
    level: float
    resamples: int
    params: float  # compute-optimal N under the parametric fit, among the caller's candidates
    tokens: float  # C / flops_per_token at that N
    loss: Estimate  # the fit's loss there; the interval is for one new run, scatter included
    fit: LossFit
    parameters: dict[str, Estimate]  # E, A, B, alpha, beta
    isoflop: IsoFlopFit | None  # None where the profiles did not bracket their minima (see notes)
    isoflop_params: Estimate  # approach 2's N*(C), extrapolated (nan without an IsoFLOP fit)
    isoflop_tokens: Estimate
    rule_params: float  # the candidate closest to TOKENS_PER_PARAM tokens per param
    rule_tokens: float
    rule_loss: float  # the parametric fit's loss there
    notes: list[str]

    def describe(self) -> list[str]:
        """Short lines for the terminal."""
        level, iso = self.level, self.isoflop

        def fitted(*names: str) -> str:
            return ", ".join(f"{k} = {self.parameters[k].text(level)}" for k in names)

        isoflop = (
            [
                f"  IsoFLOP: N* = {self.isoflop_params.text(level)} params ~ C^{iso.a:.3f}",
                f"           D* = {self.isoflop_tokens.text(level)} tokens ~ C^{iso.b:.3f}",
            ]
            if iso is not None
            else []
        )
        return [
            f"forecast at C = {_fmt(self.flops)} FLOPs ({self.resamples} bootstrap resamples)",
            f"  compute-optimal: N = {_fmt(self.params)} params, D = {_fmt(self.tokens)} tokens "
            f"({_fmt(self.tokens / self.params)} tokens/param)",
            f"  loss = {self.loss.text(level, 4)} nats, for one run",
            *isoflop,
            f"  {TOKENS_PER_PARAM:g} tokens/param: N = {_fmt(self.rule_params)} params, "
            f"D = {_fmt(self.rule_tokens)} tokens, loss = {_fmt(self.rule_loss, 4)} nats",
            f"  L = E + A/N^alpha + B/D^beta: {fitted('E', 'A', 'B')}",
            f"    {fitted('alpha', 'beta')}",
            *(f"  note: {note}" for note in self.notes),
        ]


def forecast(
    runs: Sequence[Run],
    flops: float,
    sizes: Sequence[tuple[float, float]],
    *,
    level: float = 0.9,
    resamples: int = 200,
    seed: int = 0,
) -> Forecast:
    """Forecast a run at `flops` from the series' `runs`. `sizes` are the family's candidates as
    (N params, flops_per_token) pairs, dense enough to pick the compute-optimal one from."""
    if not (math.isfinite(flops) and flops > 0):
        raise UserError(f"the budget to forecast is {flops:g} FLOPs: give a positive, finite number")
    if not sizes or not all(math.isfinite(v) and v > 0 for size in sizes for v in size):
        raise UserError("forecasting needs candidate sizes as (params, flops_per_token), all positive")
    if not (0 < level < 1 and resamples >= 1):
        raise UserError(f"level={level:g}, resamples={resamples}: the level lies in (0, 1), resamples >= 1")
    runs = _checked(runs)
    fit = fit_loss(runs)
    try:
        iso: IsoFlopFit | None = fit_isoflop(runs)
    except UserError as err:  # the forecast stands on L(N, D); approach 2 is its cross-check
        iso, notes = None, [f"no IsoFLOP fit: {err}"]
    else:
        notes = [
            f"the budget of {_fmt(p.flops)} FLOPs is left out of the power laws: {p.flag}"
            for p in iso.profiles
            if p.flag
        ]
    rng = np.random.default_rng(seed)
    iso_fits = _bootstrap(lambda s: _isoflop(_budgets(s)), _budgets(runs), resamples, rng) if iso else []
    loss_fits = _bootstrap(lambda s: fit_loss(s, start=fit), [runs], resamples, rng)

    def estimate(value: float, samples) -> Estimate:
        """`value` and its samples' central `level` (nan where no resample could be fitted)."""
        bounds = (
            np.percentile(samples, [50 * (1 - level), 50 * (1 + level)]) if len(samples) else [math.nan] * 2
        )
        return Estimate(float(value), *map(float, bounds))

    n = np.array([s[0] for s in sizes], dtype=float)
    d = flops / np.array([s[1] for s in sizes], dtype=float)
    best = int(np.argmin(fit.loss(n, d)))
    rule = int(np.argmin(np.abs(np.log(d / n / TOKENS_PER_PARAM))))
    run_n, run_d, run_loss = (np.array([getattr(r, k) for r in runs]) for k in ("params", "tokens", "loss"))
    # Per resample, its prediction times each of its residuals on every run (in-sample residuals
    # alone would understate the scatter): every residual rather than one drawn, the same distribution.
    predicted = [f.loss(n[best], d[best]) * run_loss / f.loss(run_n, run_d) for f in loss_fits]
    if best in (0, len(sizes) - 1) and len(sizes) > 1:
        notes.append("the compute-optimal size is the smallest or largest candidate: widen the candidates")
    for name, kept in (("IsoFLOP", len(iso_fits)), ("parametric", len(loss_fits))):
        if kept < resamples and (iso or name == "parametric"):
            notes.append(f"{resamples - kept} of {resamples} {name} resamples could not be fitted, skipped")
    return Forecast(
        flops=float(flops),
        level=level,
        resamples=resamples,
        params=float(n[best]),
        tokens=float(d[best]),
        loss=estimate(fit.loss(n[best], d[best]), np.concatenate(predicted) if predicted else []),
        fit=fit,
        parameters={
            k: estimate(getattr(fit, k), [getattr(f, k) for f in loss_fits])
            for k in ("E", "A", "B", "alpha", "beta")
        },
        isoflop=iso,
        isoflop_params=estimate(iso.params(flops) if iso else math.nan, [f.params(flops) for f in iso_fits]),
        isoflop_tokens=estimate(iso.tokens(flops) if iso else math.nan, [f.tokens(flops) for f in iso_fits]),
        rule_params=float(n[rule]),
        rule_tokens=float(d[rule]),
        rule_loss=float(fit.loss(n[rule], d[rule])),
        notes=notes,
    )
