"""experiments/scaling_law.py on synthetic series drawn from a known law, Chinchilla's own fit
(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, rounded) at small-model budgets, C = 6ND: the fits
recover the law, the forecast brackets a fresh run, and bad input is a one-line UserError."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from experiments.scaling_law import Run, fit_isoflop, fit_loss, forecast
from gptcore.errors import UserError

TRUE = {"E": 1.7, "A": 400.0, "B": 410.0, "alpha": 0.34, "beta": 0.28}
BUDGETS = [1e16 * 4**k for k in range(4)]
NOISE = 0.005  # log-normal, on the loss
TARGET = 4 * BUDGETS[-1]
CANDIDATES = [(n, 6 * n) for n in np.geomspace(1e6, 1e9, 400)]  # (params, flops_per_token)


def true_loss(params, tokens):
    return TRUE["E"] + TRUE["A"] / params ** TRUE["alpha"] + TRUE["B"] / tokens ** TRUE["beta"]


def optimal_params(flops: float) -> float:
    """The N minimizing true_loss(N, C / 6N): d/dN = 0 at N^(alpha+beta) = alpha A / (beta B) (C/6)^beta."""
    alpha, beta = TRUE["alpha"], TRUE["beta"]
    return (alpha * TRUE["A"] / (beta * TRUE["B"]) * (flops / 6) ** beta) ** (1 / (alpha + beta))


def series(noise: float = NOISE, octaves=range(-2, 3), budgets=BUDGETS, seed: int = 0) -> list[Run]:
    """Five sizes per budget, an octave apart around the optimum but off-centre by a different
    fraction of an octave at each budget, so that no vertex sits on a sampled size."""
    rng = np.random.default_rng(seed)
    runs = []
    for k, flops in enumerate(budgets):
        for octave in octaves:
            n = optimal_params(flops) * 2.0 ** (octave + 0.3 * (k - 1.5))
            d = flops / (6 * n)
            runs.append(Run(n, d, flops, true_loss(n, d) * math.exp(noise * rng.standard_normal())))
    return runs


@pytest.fixture(scope="module")
def noisy():
    return forecast(series(), TARGET, CANDIDATES, resamples=100)


def test_the_parametric_fit_recovers_the_law_and_its_intervals_hold_it(noisy):
    fit = noisy.fit
    assert fit.alpha == pytest.approx(TRUE["alpha"], abs=0.04)
    assert fit.beta == pytest.approx(TRUE["beta"], abs=0.04)
    assert abs(fit.E - TRUE["E"]) < 0.25
    for name, estimate in noisy.parameters.items():
        assert estimate.low < estimate.value == getattr(fit, name) < estimate.high, name
        assert estimate.low < TRUE[name] < estimate.high, name
    assert np.std(fit.residuals) == pytest.approx(NOISE, rel=0.5)


def test_without_noise_the_parametric_fit_is_exact():
    fit = fit_loss(series(noise=0.0))
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=1e-4), name
    assert max(map(abs, fit.residuals)) < 1e-6


@pytest.mark.parametrize("noise, tolerance", [(0.0, 0.03), (NOISE, 0.15)])
def test_isoflop_profiles_find_the_analytic_optimum(noise, tolerance):
    iso = fit_isoflop(series(noise))
    for profile in iso.profiles:
        assert not profile.flag
        assert profile.params == pytest.approx(optimal_params(profile.flops), rel=tolerance)
        assert profile.tokens == pytest.approx(profile.flops / (6 * profile.params), rel=1e-6)
    exponent = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert iso.a == pytest.approx(exponent, abs=tolerance / 3)
    assert iso.b == pytest.approx(1 - iso.a, abs=1e-6)  # D* = C / 6N*


def test_the_forecast_brackets_a_new_run_at_four_times_the_largest_budget(noisy):
    assert noisy.params == pytest.approx(optimal_params(TARGET), rel=0.15)
    assert noisy.tokens == TARGET / (6 * noisy.params)
    new_run = true_loss(noisy.params, noisy.tokens) * math.exp(
        NOISE * np.random.default_rng(1).standard_normal()
    )
    loss = noisy.loss
    assert loss.low < new_run < loss.high and loss.low < loss.value < loss.high
    assert loss.high - loss.low < 0.1  # and the interval says something
    iso = noisy.isoflop_params
    assert iso.value == pytest.approx(optimal_params(TARGET), rel=0.15)
    assert iso.low < optimal_params(TARGET) < iso.high
    assert noisy.rule_tokens / noisy.rule_params == pytest.approx(20, rel=0.02)
    assert noisy.rule_loss == pytest.approx(noisy.fit.loss(noisy.rule_params, noisy.rule_tokens))
    assert noisy.rule_loss > noisy.loss.value  # this law's optimum is not at 20 tokens per param
    lines = noisy.describe()
    assert lines[0] == "forecast at C = 2.56e+18 FLOPs (100 bootstrap resamples)"
    assert any(line.startswith("  loss = ") and "(90%: " in line for line in lines)
    assert json.loads(json.dumps(dataclasses.asdict(noisy)))["fit"]["alpha"] == noisy.fit.alpha


def test_a_profile_without_its_minimum_is_flagged_and_left_out():
    runs = series(noise=0.0)
    shifted = series(noise=0.0, octaves=range(2, 7), budgets=[2e15])  # every size above the optimum
    concave = [Run(n, 1e17 / (6 * n), 1e17, loss) for n, loss in [(1e6, 3.0), (2e6, 3.3), (4e6, 3.0)]]
    iso = fit_isoflop(runs + shifted + concave)
    flags = {p.flops: p.flag for p in iso.profiles}
    assert "outside the sizes tried" in flags[2e15] and "add a smaller size" in flags[2e15]
    assert "no minimum" in flags[1e17]
    assert sum(1 for flag in flags.values() if flag) == 2
    assert (iso.a, iso.b) == pytest.approx((fit_isoflop(runs).a, fit_isoflop(runs).b))


RUNS = series(noise=0.0)


@pytest.mark.parametrize(
    "fit, runs, needle",
    [
        (fit_isoflop, RUNS[:5], "span 1 compute budget"),
        (fit_isoflop, RUNS[:2] + RUNS[5:], "has 2 distinct sizes"),
        (fit_isoflop, [*RUNS[:-1], dataclasses.replace(RUNS[-1], loss=0.0)], "run 19 has"),
        (fit_loss, [dataclasses.replace(RUNS[0], tokens=math.nan), *RUNS[1:]], "positive and finite"),
        (fit_loss, RUNS[:4], "got 4 runs"),
        (fit_loss, [dataclasses.replace(run, params=1e7) for run in RUNS], "1 sizes"),
        (fit_loss, [dataclasses.replace(run, tokens=1e9) for run in RUNS], "1 token counts"),
        (fit_isoflop, series(noise=0.0, octaves=range(3, 8)), "only 0 of 4 compute budgets"),
        (lambda runs: forecast(runs, -1.0, CANDIDATES), RUNS, "-1 FLOPs"),
        (lambda runs: forecast(runs, TARGET, []), RUNS, "candidate sizes"),
    ],
)
def test_bad_input_is_a_one_line_user_error(fit, runs, needle):
    with pytest.raises(UserError) as error:
        fit(runs)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_the_forecast_is_deterministic_for_a_seed():
    runs = series()
    first, again = (dataclasses.asdict(forecast(runs, TARGET, CANDIDATES, resamples=10)) for _ in range(2))
    other = dataclasses.asdict(forecast(runs, TARGET, CANDIDATES, resamples=10, seed=1))
    assert first == again
    assert first["loss"] != other["loss"]


def test_without_an_isoflop_fit_the_forecast_stands_on_the_parametric_one():
    """Profiles that never bracket their minimum (every size above it, as a series too small for
    its sizes gives) leave approach 2 out, said in a note; L(N, D) still forecasts."""
    runs = series(noise=0.0, octaves=range(3, 8))
    result = forecast(runs, TARGET, CANDIDATES, resamples=10)
    assert result.isoflop is None and math.isnan(result.isoflop_params.value)
    assert any("no IsoFLOP fit: only 0 of 4" in note for note in result.notes), result.notes
    assert result.params == pytest.approx(optimal_params(TARGET), rel=0.15)
    lines = result.describe()
    assert not any("IsoFLOP:" in line for line in lines) and any("no IsoFLOP fit" in line for line in lines)
