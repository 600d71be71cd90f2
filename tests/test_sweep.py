"""Sweeps on a real local Ray instance, driven through the CLI as a user would.

The sweep module runs `gptrun sweep` once (a module fixture that the report tests reuse), kills a
second sweep's driver with SIGKILL and resumes it, and checks bad sweep configs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_user_error, run_cli, write_sweep_config

pytestmark = pytest.mark.ray

def trial_records(exp_dir: Path) -> dict[str, list[dict]]:
    """Every report of every trial, read from Tune's result.json files."""
    records = {}
    for result_file in exp_dir.glob("*/result.json"):
        lines = [json.loads(line) for line in result_file.read_text().splitlines() if line]
        if lines:
            records[lines[0]["trial_id"]] = lines
    return records


def test_sweep_completes_and_asha_stops_some_trials(finished_sweep):
    from experiments.results import load_trials

    trials = load_trials(finished_sweep)
    assert len(trials) == 6
    statuses = [t["status"] for t in trials]
    assert "stopped early" in statuses, statuses
    assert "completed" in statuses, statuses
    # Trial 0 is the baseline: the config's own values.
    baseline = [t for t in trials if t["config"].get("optim.lr") == pytest.approx(3e-3)]
    assert baseline, [t["config"] for t in trials]
    # The study holds every trial once, with its Tune id.
    with sqlite3.connect(finished_sweep / "optuna.db") as db:
        ids = [row[0] for row in db.execute(
            "select value_json from trial_user_attributes where key = 'tune_trial_id'")]
    assert sorted(json.loads(i) for i in ids) == sorted(t["trial_id"] for t in trials)


def test_best_toml_loads_and_trains(finished_sweep, tmp_path):
    from gptcore.config import load_config

    best = load_config(finished_sweep / "best.toml")
    assert best.optim.lr > 0
    proc = run_cli("train", str(finished_sweep / "best.toml"), "--local", "--out",
                   str(tmp_path / "best"), "--set", "train.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "best" / "checkpoints" / "last.pt").exists()


def test_existing_name_points_to_resume(finished_sweep):
    config = finished_sweep.parent.parent / "sweep.toml"
    proc = run_cli("sweep", str(config), "--name", "finished", "--storage",
                   str(finished_sweep.parent))
    assert_user_error(proc, "gptrun resume", "--restart")


def test_killed_sweep_resumes_without_losing_or_repeating_trials(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path, n=4, max_steps=120)
    storage = tmp_path / "sweeps"
    exp_dir = storage / "killed"
    args = [sys.executable, "-m", "experiments", "sweep", str(config), "--name", "killed",
            "--storage", str(storage), "--set", "sweep.grace_tokens=100000000",
            "--set", "train.eval_interval=10"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if len(list((exp_dir / "runs").glob("train-*/checkpoint_*"))) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("no trial committed a checkpoint in time")
        time.sleep(3)  # let Tune write its experiment state once more
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        # The local Ray instance the driver started lives in its process group: end it by id.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
    before = trial_records(exp_dir)
    checkpointed = {tid for tid, recs in before.items() if any("checkpoint_path" in r for r in recs)}
    proc = run_cli("resume", str(exp_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = trial_records(exp_dir)
    assert len(after) == 4, sorted(after)
    for tid in checkpointed:
        resumed = after[tid][len(before[tid]):]
        if resumed:  # an interrupted trial: it continued from its checkpoint, not from step 0
            assert resumed[0]["resumed_from"] > 0, resumed[0]
            assert resumed[0]["step"] >= before[tid][-1]["step"] - 10  # at most one interval replayed
    assert all(recs[-1]["tokens"] >= recs[0]["tokens"] for recs in after.values())
    with sqlite3.connect(exp_dir / "optuna.db") as db:
        ids = [json.loads(r[0]) for r in db.execute(
            "select value_json from trial_user_attributes where key = 'tune_trial_id'")]
        states = [r[0] for r in db.execute("select state from trials")]
    assert sorted(ids) == sorted(after), (ids, sorted(after))
    assert len(states) == 4 and set(states) == {"COMPLETE"}, states


@pytest.mark.parametrize("override, needle", [
    ("sweep.space.lr={ loguniform = [1e-2, 1e-3] }", "range [0.01, 0.001] is empty"),
    ("sweep.space.lr={ uniform = [0.0, 1e-3] }", "learning rate must be > 0"),
    ("sweep.space.lrr={ uniform = [0.1, 0.2] }", "not a config key that can be searched"),
    ("resources.gpus_per_worker=1", "needs"),
    ("optim.warmup=0.5", "lies outside its sweep.space range"),
])
def test_bad_sweep_configs_are_one_line(tiny_data, tmp_path, override, needle):
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
    env = {"GPTRUN_RESOURCE_WAIT_S": "1"}
    proc = run_cli("sweep", str(config), "--storage", str(tmp_path / "s"), "--set", override,
                   env=env, timeout=120)
    assert_user_error(proc, needle)
