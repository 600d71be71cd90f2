"""The one outcome rule and the study as the record of each trial's life: what an end is told as,
and what a resume makes of a study that is newer than Tune's saved searcher. A real sqlite
study and Ray's real OptunaSearch (no Ray session is needed to drive a searcher)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.outcome import best_trial, ended_status, ranked
from experiments.record import read_records

FULL = 100.0


def one_float(trial) -> dict[str, float]:
    """The search space, a module-level function (a saved searcher pickles it)."""
    return {"x": trial.suggest_float("x", 0.0, 1.0)}


def searcher(url: str, num_samples: int = 3):
    from ray.tune.search.optuna import OptunaSearch

    from experiments.study import StudySearch
    from experiments.study_db import rdb_storage

    search = StudySearch(
        full_tokens=int(FULL),
        num_samples=num_samples,
        space=one_float,
        study_name="s",
        metric="val_loss",
        mode="min",
        storage=rdb_storage(url),
    )
    assert isinstance(search, OptunaSearch)
    return search


def save_tune_trials(folder: Path, tune_trials: dict[str, str]) -> None:
    """Tune's saved trials (id -> status) in the JSON shape of its experiment_state file, in the
    folder where it keeps its searcher's file."""
    import json

    trial_data = [
        [json.dumps({"trial_id": t, "status": s, "config": {}, "relative_logdir": t}), "{}"]
        for t, s in tune_trials.items()
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "experiment_state-2026-12-07_00-00-00.json").write_text(json.dumps({"trial_data": trial_data}))


@pytest.mark.parametrize(
    "result, cut, status",
    [
        (None, False, "error"),
        ({"val_loss": 9.0, "tokens": FULL, "error": 1.0}, False, "error"),
        ({"val_loss": 9.0, "tokens": FULL, "diverged": 1.0}, False, "diverged"),
        ({"val_loss": 9.0, "tokens": FULL, "refused": 1.0}, False, "refused"),
        ({"val_loss": 3.0, "tokens": FULL}, False, "completed"),
        ({"val_loss": 3.0, "tokens": 40.0}, False, "stopped early"),
        ({"val_loss": 3.0, "tokens": 40.0}, True, "cut by budget"),
    ],
)
def test_ended_status(result, cut, status):
    assert ended_status(result, FULL, cut=cut) == status


def test_best_and_ranked_leave_out_errors_and_nan_losses():
    trials = [
        {"trial_id": "a", "status": "stopped early", "val_loss": 2.0},
        {"trial_id": "b", "status": "completed", "val_loss": float("nan")},
        {"trial_id": "c", "status": "completed", "val_loss": 3.0},
        {"trial_id": "d", "status": "error", "val_loss": 1.0},
        {"trial_id": "e", "status": "cut by budget", "val_loss": 2.5},
    ]
    assert best_trial(trials)["trial_id"] == "a"
    assert [t["trial_id"] for t in ranked(trials)] == ["c", "a", "e"]


def test_an_error_is_fail_while_divergence_is_scored(tmp_path: Path):
    """An infrastructure failure says nothing about the hyperparameters (FAIL, with its reason,
    left out of TPE and warm starts); a divergence is scored with its bad loss (COMPLETE)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search = searcher(url)
    for tid in "abc":
        search.suggest(tid)
    search.on_trial_complete("a", {"val_loss": 12.0, "tokens": FULL, "error": 1.0, "reason": "out of memory"})
    search.on_trial_complete(
        "b", {"val_loss": 12.0, "tokens": FULL, "diverged": 1.0, "reason": "loss is nan"}
    )
    search.on_trial_result("c", {"val_loss": 4.0, "tokens": 20.0})
    search.on_trial_complete("c", {"val_loss": 3.0, "tokens": 40.0})
    records = read_records(url, "s")
    assert (records["a"].state, records["a"].status, records["a"].final["reason"]) == (
        "FAIL",
        "error",
        "out of memory",
    )
    assert (records["b"].state, records["b"].status) == ("COMPLETE", "diverged")
    assert (records["c"].state, records["c"].status, records["c"].final["tokens"]) == (
        "PRUNED",
        "stopped early",
        40.0,
    )
    assert all(records[t].config == {"x": pytest.approx(records[t].config["x"])} for t in "abc")


def test_a_trial_whose_process_died_on_every_try_is_fail_with_a_reason(tmp_path: Path):
    """The trial function reports every error it can catch (FAIL with its reason); Tune tells
    the searcher an error only once its retries (max_failures) are spent on a process that died
    (a lost node, a kill for memory), with no result: that end is FAIL too, keeping the trial's
    last report and saying what happened, not an empty record."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search = searcher(url)
    search.suggest("a")
    search.on_trial_result("a", {"val_loss": 4.0, "tokens": 20.0, "step": 2.0})
    search.on_trial_complete("a", None, error=True)
    record = read_records(url, "s")["a"]
    assert (record.state, record.status, record.final["tokens"]) == ("FAIL", "error", 20.0)
    assert "each try" in record.final["reason"] and "error.txt" in record.final["reason"]


def test_a_resume_reconciles_the_saved_searcher_to_the_study(tmp_path: Path):
    """Tune's saved searcher is as old as its last snapshot. A trial the study saw end is not told
    again; a trial asked after the snapshot (Tune never saved it) goes to the next new Tune
    trial with its own values; once the study holds num_samples trials, no more are asked."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search = searcher(url)
    search.suggest("a")
    search.suggest("b")
    save_tune_trials(tmp_path, {"a": "RUNNING", "b": "RUNNING"})  # Tune's snapshot
    search.save(str(tmp_path / "searcher.pkl"))
    orphan = search.suggest("c")  # asked after it, then the driver is killed
    search.on_trial_complete("a", {"val_loss": 3.0, "tokens": FULL})

    resumed = searcher(url)
    resumed.restore(str(tmp_path / "searcher.pkl"))
    resumed.on_trial_complete("a", {"val_loss": 5.0, "tokens": FULL})  # a replayed end: ignored
    assert resumed.suggest("d") == orphan  # the orphan runs under the new Tune trial
    from ray.tune.search import Searcher

    assert resumed.suggest("e") == Searcher.FINISHED
    records = read_records(url, "s")
    assert sorted(records) == ["a", "b", "d"]
    assert (records["a"].state, records["a"].final["val_loss"]) == ("COMPLETE", 3.0)


def test_a_saved_searcher_older_than_tunes_trials_drops_no_end_and_waits_for_none(tmp_path: Path):
    """Tune saves its trials and its searcher in separate files; a kill while they are uploaded to
    object storage can leave the trials newer (CI saw it on the moto server). A trial Tune
    restores that the saved searcher never asked runs on under its own id (not handed to a new
    one as well), its reports and end reach the study, and the trials at once are counted from
    what runs now: Ray's ConcurrencyLimiter, which kept its own stale list, dropped that end and
    waited for a trial that had ended."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search = searcher(url, num_samples=4)
    search.set_max_concurrency(2)
    search.suggest("a")
    search.save(str(tmp_path / "searcher.pkl"))  # the searcher's file: as of a alone
    b = search.suggest("b")
    assert search.suggest("x") is None  # two running: the limit
    search.on_trial_complete("a", {"val_loss": 3.0, "tokens": FULL})
    save_tune_trials(tmp_path, {"a": "TERMINATED", "b": "RUNNING"})  # Tune's, saved later

    resumed = searcher(url, num_samples=4)
    resumed.set_max_concurrency(2)
    resumed.restore(str(tmp_path / "searcher.pkl"))
    resumed.on_trial_result("b", {"val_loss": 4.0, "tokens": 40.0})
    c = resumed.suggest("c")
    assert c not in (None, b)  # b runs on under its own id: a new trial is a new config
    assert resumed.suggest("d") is None  # b and c running: the limit
    resumed.on_trial_complete("b", {"val_loss": 3.5, "tokens": FULL})
    assert resumed.suggest("d") is not None
    records = read_records(url, "s")
    assert sorted(records) == ["a", "b", "c", "d"]
    assert (records["b"].state, records["b"].final["val_loss"]) == ("COMPLETE", 3.5)
    assert records["b"].continues == []
