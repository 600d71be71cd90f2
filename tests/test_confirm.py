"""The noise check and the trackers, on the session's real finished sweep (`finished_sweep` runs
with `confirm_top = 2`, `confirm_seeds = 2` and MLflow logging to sqlite).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from experiments.confirm import ranked_trials
from experiments.results import load_trials
from gptcore.config import load_config
from tests.conftest import assert_user_error, run_cli

pytestmark = pytest.mark.ray


def _confirm_trial_dirs(exp_dir: Path) -> list[Path]:
    return sorted(p for p in (exp_dir / "confirm").iterdir() if p.name.startswith("run_trial_"))


def test_sweep_reruns_its_best_configs_with_new_seeds(finished_sweep: Path) -> None:
    noise = json.loads((finished_sweep / "noise.json").read_text())
    ranked = ranked_trials(load_trials(finished_sweep))  # completed, then stopped early
    sweep_seed = load_config(finished_sweep / "gptrun.toml").train.seed
    rows = noise["candidates"]
    assert sorted(r["trial_id"] for r in rows) == sorted(t["trial_id"] for t in ranked[:2])
    for row in rows:
        assert row["seeds"] == [sweep_seed + 1, sweep_seed + 2]
        assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
        assert row["mean"] == pytest.approx(statistics.fmean(row["losses"]))
        assert row["std"] == pytest.approx(statistics.stdev(row["losses"]))
    assert rows[0]["mean"] <= rows[1]["mean"]  # ranked by the mean over new seeds
    cmp = noise["comparison"]
    assert (cmp["best"], cmp["runner_up"]) == (rows[0]["trial_id"], rows[1]["trial_id"])
    assert 0.0 <= cmp["p_value"] <= 1.0 and cmp["separated"] == (cmp["p_value"] < 0.05)
    pooled = statistics.fmean(r["std"] ** 2 for r in rows)
    assert noise["seed_std"] == pytest.approx(math.sqrt(pooled))
    every = rows[0]["losses"] + rows[1]["losses"]
    assert noise["noise_fraction"] == pytest.approx(pooled / statistics.variance(every))

    confirm_trials = load_trials(finished_sweep / "confirm")  # full budget, nothing stopped
    assert len(confirm_trials) == 4 and {t["status"] for t in confirm_trials} == {"completed"}
    log = (finished_sweep.parent.parent / "sweep.log").read_text()
    assert "confirm" in log and "Welch p =" in log and "seed noise: std" in log


def test_confirm_command_resumes_the_same_plan_and_refuses_another(finished_sweep: Path) -> None:
    before = _confirm_trial_dirs(finished_sweep)
    proc = run_cli("confirm", str(finished_sweep), "--top", "2", "--seeds", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(resuming)" in proc.stdout and "Welch p =" in proc.stdout
    assert _confirm_trial_dirs(finished_sweep) == before  # finished runs are not run again

    assert_user_error(run_cli("confirm", str(finished_sweep), "--top", "1", "--seeds", "3"),
                      "--restart")
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
    assert "src='noise.png'" in page and "Seed noise: std" in page
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

    trial_dirs = [p for p in finished_sweep.iterdir() if p.name.startswith("run_trial_")]
    assert len(trial_dirs) == 6
    for trial_dir in trial_dirs:
        events = EventAccumulator(str(trial_dir))
        events.Reload()
        hparams = events.PluginTagToContent("hparams")
        assert hparams, trial_dir
        assert any(b"optim.lr" in content for content in hparams.values())
        assert "ray/tune/val_loss" in events.Tags()["scalars"]
