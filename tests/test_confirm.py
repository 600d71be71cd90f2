"""The noise check: its statistics on small made-up inputs with the expected numbers worked out by
hand (fast, no Ray), then the command and the trackers on the session's real finished sweep
(`finished_sweep` runs with `confirm_top = 2`, `confirm_seeds = 2` and MLflow logging to sqlite).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import t as student_t

from experiments.noise import compare, measure_noise, noise_line, print_noise, verdict
from experiments.outcome import ranked
from experiments.ray_config import load_experiment
from experiments.results import load_trials
from tests.conftest import assert_user_error, run_cli, write_sweep_config


def _trial(tid: str, status: str, loss: float, **config: Any) -> dict[str, Any]:
    return {"trial_id": tid, "status": status, "val_loss": loss, "config": config}


def _row(tid: str, losses: list[float], mean: float, std: float) -> dict[str, Any]:
    return {"trial_id": tid, "losses": losses, "mean": mean, "std": std}


SWEEP = [
    _trial("a", "completed", 5.0, **{"optim.lr": 1e-3}),
    _trial("b", "completed", 5.4, **{"optim.lr": 2e-3}),
    _trial("c", "completed", 5.6),
    _trial("d", "completed", 6.0),
    _trial("e", "stopped early", 7.0),
    _trial("f", "cut by budget", 6.5),
    _trial("g", "diverged", math.nan),
]


def _rerun(candidate: str, seed: int, loss: float, status: str = "completed") -> dict[str, Any]:
    return _trial(f"{candidate}{seed}", status, loss, candidate=candidate, **{"train.seed": seed})


def test_noise_figures_by_hand() -> None:
    """a: 5.0, 5.2 (its third seed errored); b: 5.3, 5.4, 5.8. By hand: means 5.1 and 5.5;
    variances 0.02 and 0.07; pooled with weights n - 1: (0.02 + 2 * 0.07) / 3 = 0.16 / 3. The
    sweep's completed trials 5.0, 5.4, 5.6, 6.0 (stopped early, cut by budget and diverged left
    out): variance 0.52 / 3, so the noise fraction is 0.16 / 0.52 = 4 / 13. (Pooling without the
    weights would give 0.045; the variance of all re-runs 0.088, a fraction of 0.606.)"""
    reruns = [
        _rerun("a", 1, 5.0),
        _rerun("a", 2, 5.2),
        _rerun("a", 3, math.nan, "error"),
        _rerun("b", 3, 5.8),
        _rerun("b", 1, 5.3),
        _rerun("b", 2, 5.4),
    ]
    noise = measure_noise(SWEEP, reruns, {"candidates": ["b", "a"], "seeds": [1, 2, 3]})

    a, b = noise["candidates"]  # best mean first
    assert (a["trial_id"], a["seeds"], a["losses"]) == ("a", [1, 2], [5.0, 5.2])
    assert (b["trial_id"], b["seeds"], b["losses"]) == ("b", [1, 2, 3], [5.3, 5.4, 5.8])
    assert a["params"] == {"lr": 1e-3} and a["sweep_val_loss"] == 5.0 and b["sweep_val_loss"] == 5.4
    assert a["mean"] == pytest.approx(5.1) and a["std"] == pytest.approx(0.1414213562)
    assert b["mean"] == pytest.approx(5.5) and b["std"] == pytest.approx(0.2645751311)
    assert noise["seed_std"] == pytest.approx(0.2309401077)  # sqrt(0.16 / 3)
    assert noise["sweep_std"] == pytest.approx(0.4163331999)  # sqrt(0.52 / 3)
    assert noise["sweep_completed"] == 4
    assert noise["noise_fraction"] == pytest.approx(0.3076923077)  # 4 / 13
    # Welch: t = 0.4 / sqrt(0.02/2 + 0.07/3) = 2.191 on 2.985 degrees of freedom
    assert noise["comparison"] == {
        "best": "a",
        "runner_up": "b",
        "difference": pytest.approx(0.4),
        "p_value": pytest.approx(0.1166053974),
        "separated": False,
    }
    assert noise_line(noise) == (
        "seed noise: std 0.2309 nats (pooled over the re-runs), 31% of the "
        "variance between the sweep's 4 completed trials (std 0.4163): "
        "near 100% their differences are mostly noise"
    )


def test_compare_uses_welch_not_student() -> None:
    """A tight best (n = 8) against a wide runner-up (n = 4): Student's pooled variance is
    dominated by the tight group and calls them separated; Welch's test does not."""
    from scipy.stats import ttest_ind

    tight = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00, 1.01]
    wide = [1.05, 1.45, 0.95, 1.55]
    student = ttest_ind(tight, wide, equal_var=True).pvalue
    assert student < 0.05 and abs(student - 0.1896063598) > 0.1  # the case tells the two apart
    cmp = compare([_row("t", tight, 1.00125, 0.0124642345), _row("w", wide, 1.25, 0.2943920288)])
    assert cmp == {
        "best": "t",
        "runner_up": "w",
        "difference": pytest.approx(0.24875),
        "p_value": pytest.approx(0.1896063598),
        "separated": False,
    }


def test_compare_identical_runs_and_verdicts() -> None:
    apart = compare([_row("x", [1.0, 1.0], 1.0, 0.0), _row("y", [1.2, 1.2], 1.2, 0.0)])
    assert (apart["p_value"], apart["separated"]) == (0.0, True)
    tie = compare([_row("x", [1.0, 1.0], 1.0, 0.0), _row("y", [1.0, 1.0], 1.0, 0.0)])
    assert (tie["p_value"], tie["separated"]) == (1.0, False)
    assert compare([_row("x", [1.0, 1.1], 1.05, 0.07)]) is None

    assert verdict({"alpha": 0.05, "comparison": apart}) == (
        "best x vs runner-up y: 0.2000 nats apart, Welch p = 0 < 0.05: the best is separated from "
        "the runner-up"
    )
    assert verdict({"alpha": 0.05, "comparison": tie}).endswith(
        "Welch p = 1 >= 0.05: the difference is within seed noise"
    )
    assert verdict({"alpha": 0.05, "comparison": None}) == (
        "fewer than two configs were re-run, so the winner was not compared"
    )


def test_noise_without_a_sweep_spread_or_enough_reruns() -> None:
    """One completed sweep trial gives no spread to compare with; one re-run per config, no seed
    variance: both say so instead of printing nan."""
    sweep = [_trial("a", "completed", 5.0), _trial("b", "stopped early", 5.9)]
    reruns = [_rerun("a", 1, 5.0), _rerun("a", 2, 5.2), _rerun("b", 1, 5.5)]
    noise = measure_noise(sweep, reruns, {"candidates": ["a", "b"], "seeds": [1, 2]})
    assert noise["sweep_completed"] == 1 and math.isnan(noise["noise_fraction"])
    assert noise["comparison"] is None  # b has one run: nothing to test against
    assert noise_line(noise) == (
        "seed noise: std 0.1414 nats (pooled over the re-runs); not "
        "compared with the sweep: its 1 completed trial(s) show no spread"
    )
    lonely = measure_noise(sweep, reruns[2:], {"candidates": ["b"], "seeds": [1, 2]})
    assert noise_line(lonely) == "seed noise: not measured (no config has two completed re-runs)"


def test_print_noise_table(capsys: pytest.CaptureFixture[str]) -> None:
    reruns = [
        _rerun("a", 1, 5.0),
        _rerun("a", 2, 5.2),
        _rerun("b", 1, 5.3),
        _rerun("b", 2, 5.4),
        _rerun("b", 3, 5.8),
    ]
    print_noise(measure_noise(SWEEP, reruns, {"candidates": ["a", "b"], "seeds": [1, 2, 3]}))
    assert capsys.readouterr().out.splitlines() == [
        "#  trial     lr  sweep loss    mean     std  runs",
        "1      a  0.001      5.0000  5.1000  0.1414     2",
        "2      b  0.002      5.4000  5.5000  0.2646     3",
        "best a vs runner-up b: 0.4000 nats apart, Welch p = 0.117 >= 0.05: the difference is within "
        "seed noise",
        "seed noise: std 0.2309 nats (pooled over the re-runs), 31% of the variance between the "
        "sweep's 4 completed trials (std 0.4163): near 100% their differences are mostly noise",
    ]


def test_only_the_sweep_counts_its_budget(tiny_data: Path, tmp_path: Path) -> None:
    """`sweep.budget` bounds the sweep, not its confirm: the confirm's Tuner (a grid's, as
    `gptrun scale`'s) has no budget (with the sweep's, a confirm that outlasted it would end its
    re-runs and announce them as "cut by the sweep budget"). No Ray: the Tuner is built, not run,
    as confirm builds it."""
    from experiments.confirm import Candidates
    from experiments.grid import grid_tuner

    cfg = load_experiment(
        write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8, sweep_keys='budget = "1m"')
    )
    grid = {"candidate": ["a"], "train.seed": [1, 2]}
    confirm = grid_tuner(
        cfg, Candidates({"a": {}}), tmp_path / "confirm", 1, grid=grid, restore=False, tracking_name="c"
    )
    run_config = confirm._local_tuner.get_run_config()  # Ray keeps it on its local TunerInternal
    assert run_config.stop is None, run_config.stop


def _confirm_trial_dirs(exp_dir: Path) -> list[Path]:
    return sorted(p for p in (exp_dir / "confirm").iterdir() if p.name.startswith("trial_"))


def test_sweep_reruns_its_best_configs_with_new_seeds(finished_sweep: Path) -> None:
    noise = json.loads((finished_sweep / "noise.json").read_text())
    candidates = ranked(load_trials(finished_sweep))  # completed, then stopped early
    sweep_seed = load_experiment(finished_sweep / "gptrun.toml").train.seed
    rows = noise["candidates"]
    assert sorted(r["trial_id"] for r in rows) == sorted(t["trial_id"] for t in candidates[:2])
    for row in rows:
        assert row["seeds"] == [sweep_seed + 1, sweep_seed + 2]
        assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    assert rows[0]["mean"] <= rows[1]["mean"]  # ranked by the mean over new seeds
    # Welch's test worked out from the stored losses: t, the Welch-Satterthwaite degrees of
    # freedom, the two-sided p (the statistics are checked on hand-made inputs above).
    best, runner_up = rows[0]["losses"], rows[1]["losses"]
    va, vb = statistics.variance(best) / len(best), statistics.variance(runner_up) / len(runner_up)
    difference = statistics.fmean(runner_up) - statistics.fmean(best)
    dof = (va + vb) ** 2 / (va**2 / (len(best) - 1) + vb**2 / (len(runner_up) - 1))
    p = 2 * student_t.sf(abs(difference) / math.sqrt(va + vb), dof)
    assert noise["comparison"] == {
        "best": rows[0]["trial_id"],
        "runner_up": rows[1]["trial_id"],
        "difference": pytest.approx(difference),
        "p_value": pytest.approx(p),
        "separated": bool(p < 0.05),
    }
    completed = [t for t in load_trials(finished_sweep) if t["status"] == "completed"]
    assert noise["sweep_completed"] == len(completed)  # the figures are tested by hand above

    confirm_trials = load_trials(finished_sweep / "confirm")  # full length, nothing stopped
    assert len(confirm_trials) == 4 and {t["status"] for t in confirm_trials} == {"completed"}
    log = (finished_sweep.parent.parent / "sweep.log").read_text()
    assert "confirm" in log and "Welch p =" in log and "seed noise: std" in log


def test_confirm_command_resumes_the_same_plan_and_refuses_another(finished_sweep: Path) -> None:
    before = _confirm_trial_dirs(finished_sweep)
    proc = run_cli("confirm", str(finished_sweep), "--top", "2", "--seeds", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(resuming)" in proc.stdout and "Welch p =" in proc.stdout
    assert _confirm_trial_dirs(finished_sweep) == before  # finished runs are not run again

    assert_user_error(run_cli("confirm", str(finished_sweep), "--top", "1", "--seeds", "3"), "--restart")
    assert_user_error(run_cli("confirm", str(finished_sweep), "--seeds", "1"), "--seeds >= 2")
    assert_user_error(run_cli("confirm", str(finished_sweep / "runs")), "not a gptrun sweep")


def test_report_shows_the_noise(finished_sweep: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    proc = run_cli("report", str(finished_sweep), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Welch p =" in proc.stdout
    image = imread(tmp_path / "noise.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 400
    page = (tmp_path / "report.html").read_text()
    assert "<img src='data:image/png;base64," in page and "alt='noise'" in page  # noise.png, inline
    assert "Seed noise: std" in page
    assert "has not been measured" not in page


def test_mlflow_gets_one_run_per_trial_with_params_and_metrics(finished_sweep: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{finished_sweep.parent.parent}/mlflow.db")
    for name, n_trials, param in (("finished", 6, "optim.lr"), ("finished-confirm", 4, "train.seed")):
        experiment = client.get_experiment_by_name(name)
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == n_trials, name
        for run in runs:
            assert param in run.data.params
            assert math.isfinite(run.data.metrics["val_loss"])


def test_tensorboard_hparams_for_every_trial(finished_sweep: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trial_dirs = [p for p in finished_sweep.iterdir() if p.name.startswith("trial_")]
    assert len(trial_dirs) == 6
    for trial_dir in trial_dirs:
        events = EventAccumulator(str(trial_dir))
        events.Reload()
        hparams = events.PluginTagToContent("hparams")
        assert hparams, trial_dir
        assert any(b"optim.lr" in content for content in hparams.values())
        assert "ray/tune/val_loss" in events.Tags()["scalars"]
