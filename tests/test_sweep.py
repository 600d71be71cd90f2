"""Sweeps on a real local Ray instance, driven through the CLI as a user would.

The sweep module runs `gptrun sweep` once (a module fixture that the report tests reuse), kills a
second sweep's driver with SIGKILL and resumes it, and checks bad sweep configs.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from experiments.events import budget_spent
from experiments.experiment import read_events
from experiments.ray_config import SweepLimit, load_experiment, parse_budget
from experiments.sizing import sweep_limit
from gptcore.errors import UserError
from tests.conftest import (
    assert_user_error,
    kill_when,
    run_cli,
    saved_trials,
    study_trials,
    study_values,
    write_sweep_config,
)


def trial_records(exp_dir: Path) -> dict[str, list[dict]]:
    """Every report of every trial, read from Tune's result.json files (a last line cut short by
    a killed or stopped driver is left out)."""
    records = {}
    for result_file in exp_dir.glob("*/result.json"):
        lines = []
        for line in result_file.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(line))
        if lines:
            records[lines[0]["trial_id"]] = lines
    return records


def kill_when_interrupted(args: list[str], exp_dir: Path, steps: int, every: int) -> dict:
    """SIGKILL a sweep driver once a trial is mid-way (2 intervals reported, not finished) and
    Tune has saved every such trial within 2 intervals of its last report (a checkpoint to
    resume from); return the result records seen at the kill."""
    seen: dict = {}

    def ready() -> bool:
        seen.clear()
        seen.update(trial_records(exp_dir))
        saved = saved_trials(exp_dir)
        midway = [
            (tid, recs[-1]["step"]) for tid, recs in seen.items() if 2 * every <= recs[-1]["step"] < steps
        ]
        return bool(midway) and all(
            saved.get(tid, ("", 0.0))[1] >= max(2 * every, step - 2 * every) for tid, step in midway
        )

    kill_when(args, ready, "a trial got half-way")
    return seen


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
    assert_asha_stops_pruned(trials, study_rows(finished_sweep))
    # Each trial ran on this machine's node, and its fixed cost was measured.
    nodes = {t["node_id"] for t in trials}
    assert len(nodes) == 1 and bytes.fromhex(nodes.pop()), [t["node_id"] for t in trials]
    assert all(0 <= t["startup_s"] < math.inf for t in trials), [t["startup_s"] for t in trials]


def test_sweep_budget_cuts_trials_and_says_so(tiny_data, tmp_path):
    """`sweep.budget` ends the sweep: the trials it ends are "cut by budget", not ASHA's "stopped
    early", PRUNED in the study, announced on the console, and still count for best.toml.

    A budget in tokens, so that what it cuts does not hang on the machine's speed: one trial at
    a time, and 1.5 trials' worth (no ASHA stop): the first trial completes, and the second is
    cut at the report that spends the budget, half-way."""
    from experiments.results import load_trials

    steps = 40
    full = 4 * 32 * steps  # tokens per trial: batch 4 x seq_len 32 x steps
    config = write_sweep_config(tiny_data, tmp_path, n=3, max_steps=steps, sweep_keys="max_concurrent = 1")
    storage = tmp_path / "sweeps"
    proc = run_cli(
        "sweep", str(config), "--name", "cut", "--storage", str(storage),
        "--set", f'sweep.budget="{full * 3 // 2} tokens"', "--set", "sweep.grace_tokens=100000000",
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = {t["status"]: t for t in load_trials(storage / "cut")}
    assert sorted(trials) == ["completed", "cut by budget"], list(trials)
    cut = trials["cut by budget"]
    assert full / 2 <= cut["tokens"] < full, cut  # at the report that spent the budget
    assert f"trial {cut['trial_id']} cut by the sweep budget at " in proc.stdout
    assert dict(study_rows(storage / "cut"))[cut["trial_id"]] == "PRUNED"
    assert (storage / "cut" / "best.toml").is_file()


def test_a_budget_is_a_duration_or_tokens():
    """One key, `sweep.budget`, for both kinds: the unit says which; anything else is refused."""
    assert parse_budget("1h30m") == SweepLimit(5400.0)
    assert parse_budget("20M tokens") == SweepLimit(20e6, tokens=True)
    assert parse_budget(" 1.5k  Tokens") == SweepLimit(1500.0, tokens=True)
    assert parse_budget("2e7 tokens") == SweepLimit(2e7, tokens=True)
    for text, needle in [
        ("x tokens", "is not a number of tokens"),
        ("5mk tokens", "is not a number of tokens"),
        ("-5 tokens", "must be a positive, finite number of tokens"),
        ("nan tokens", "must be a positive, finite number of tokens"),
        ("2 hours", "is neither a duration nor tokens"),
    ]:
        with pytest.raises(UserError, match=needle):
            parse_budget(text)


def test_the_budget_stops_the_sweep_once_spent_and_its_cut_trials_end_once(tiny_data, tmp_path):
    """The Tuner gets `sweep.budget` as its stopper. Spent: the tokens of each trial's latest
    report, summed, or the seconds of the sweep. Tune keeps the stopper in its saved state, and
    what it spent comes back with it (a resume), less the time between the kill and the resume.
    Once spent, it says so once (a `budget_spent` event), and the trials running at the end are
    ended once each. No Ray: the Tuner is built, not run; the trials and the clock are made up."""
    from experiments.events import SweepBudget, TrialEvents
    from experiments.space import parse_space
    from experiments.tuner import new_tuner

    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8, sweep_keys='budget = "90s"')
    cfg = load_experiment(config)
    exp_dir = tmp_path / "sweep"
    exp_dir.mkdir()
    tuner = new_tuner(cfg, parse_space(cfg), exp_dir, 1, budget=sweep_limit(cfg))
    clock = tuner._local_tuner.get_run_config().stop  # Ray keeps it on its local TunerInternal
    assert isinstance(clock, SweepBudget) and clock.limit == SweepLimit(90.0)
    assert not clock.stop_all()
    clock.spent_s = 89.0  # as if 89 s went by
    resumed = pickle.loads(pickle.dumps(clock))  # as Tune saves and restores it
    assert resumed.last_check is None and not resumed.stop_all()  # the time since the kill is not spent
    resumed.spent_s = 90.0
    assert resumed.stop_all() and budget_spent(exp_dir)

    exp_dir = tmp_path / "tokens"
    exp_dir.mkdir()
    tokens = SweepBudget(exp_dir, SweepLimit(3000, tokens=True))
    assert tokens("a", {"tokens": 1024}) is False and tokens("b", {"tokens": 1024}) is False
    tokens = pickle.loads(pickle.dumps(tokens))  # a resume: the tokens reported before the kill
    tokens("b", {"tokens": 1536})  # b's latest report replaces its earlier one
    assert not tokens.stop_all() and not budget_spent(exp_dir)
    tokens("c", {"tokens": 512})
    assert tokens.stop_all() and tokens.stop_all()
    assert [e["event"] for e in read_events(exp_dir)] == ["budget_spent"]  # once

    def trial(tid: str, tokens: int, status: str = "TERMINATED") -> Any:
        return SimpleNamespace(trial_id=tid, last_result={"tokens": tokens}, status=status, config={})

    events = TrialEvents(exp_dir, full_tokens=4096)
    events.setup()
    running = [
        trial("a", 4096),
        trial("b", 1536),
        trial("c", 512),
        SimpleNamespace(trial_id="d", last_result={}),
    ]
    events.on_trial_complete(0, running, running[0])
    events.on_experiment_end(running)
    events.on_experiment_end(running)
    ends = [e["trial_id"] for e in read_events(exp_dir) if e["event"] == "end"]
    assert ends == ["a", "b", "c"]  # d never reported: it never ran


def test_best_toml_loads_and_trains(finished_sweep, tmp_path):
    from experiments.ray_config import load_experiment

    best = load_experiment(finished_sweep / "best.toml")
    assert best.optim.lr > 0
    proc = run_cli(
        "train",
        str(finished_sweep / "best.toml"),
        "--local",
        "--out",
        str(tmp_path / "best"),
        "--set",
        "train.max_steps=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "best" / "checkpoints" / "last.pt").exists()


def test_existing_name_points_to_resume(finished_sweep):
    config = finished_sweep.parent.parent / "sweep.toml"
    proc = run_cli("sweep", str(config), "--name", "finished", "--storage", str(finished_sweep.parent))
    assert_user_error(proc, "gptrun resume", "--restart")


def study_rows(exp_dir: Path) -> list[tuple[str, str]]:
    """(Tune trial id, Optuna state) of every trial in the experiment's sqlite study."""
    return study_trials(f"sqlite:///{exp_dir / 'optuna.db'}", exp_dir.name)


def assert_asha_stops_pruned(trials: list[dict], rows: list[tuple[str, str]]) -> None:
    """The study holds every trial once, with its Tune id; ASHA's stops are PRUNED, not COMPLETE."""
    states = dict(rows)
    assert sorted(tid for tid, _ in rows) == sorted(t["trial_id"] for t in trials), (rows, trials)
    for t in trials:
        assert states[t["trial_id"]] == ("PRUNED" if t["status"] == "stopped early" else "COMPLETE"), (
            t,
            states,
        )


def assert_resumed_study(rows: list[tuple[str, str]], after: dict) -> None:
    """After a kill and a resume, each Tune trial is in the study once and ended; a trial asked
    by the killed driver before Tune saved it ran under a new Tune trial (none FAIL, none left
    RUNNING)."""
    assert sorted(tid for tid, _ in rows) == sorted(after), (rows, sorted(after))  # each Tune trial once
    assert {state for _, state in rows} == {"COMPLETE"}, rows


@pytest.mark.slow  # kill tests are the system tier
def test_kill_anywhere(tiny_data, tmp_path):
    """The driver SIGKILLed at chosen moments (right after a trial starts, during a resume, right
    after a trial ends and after ASHA stops one, while a checkpoint is written, at the very end),
    each followed by `gptrun resume`: every trial trained once, no ended trial's result changed,
    interrupted trials continued from their newest checkpoint, no end announced twice, and the
    study equal to the report (benchmarks/kill_anywhere.py)."""
    from benchmarks.kill_anywhere import CHOSEN, Sweep, kill_and_resume

    n = 8
    config = write_sweep_config(tiny_data, tmp_path, n=n, max_steps=60)
    overrides = ["train.eval_interval=10", "train.checkpoint_interval=10"]
    sweep = Sweep(config, str(tmp_path / "sweeps"), "anywhere", overrides, {})
    missed = kill_and_resume(sweep, list(CHOSEN))
    assert not missed, (missed, sweep.outputs)
    verdict = sweep.verdict(n)
    assert verdict.clean, (verdict, sweep.outputs[-1][-3000:])


def test_a_searcher_file_older_than_tunes_trials_loses_and_repeats_nothing(tiny_data, tmp_path):
    """Tune saves its trials and its searcher in separate files, and a kill while they are
    uploaded to object storage can leave the searcher's older (CI saw it on the moto server: a
    trial's end never reached the study). Made here on purpose, one trial at a time: killed once
    Tune has saved a first trial running, resumed, killed once it has saved a second; that
    second run's searcher files deleted, so the resume restores the first run's. The trial Tune
    restores that this searcher never asked runs on under its own id, its end is recorded, and
    the sweep goes on (Ray's ConcurrencyLimiter, restored from the old file, waited forever for
    the first trial, long ended)."""
    from benchmarks.kill_anywhere import Moment, Sweep

    n = 3
    config = write_sweep_config(tiny_data, tmp_path, n=n, max_steps=60, sweep_keys="max_concurrent = 1")
    overrides = ["train.eval_interval=10", "train.checkpoint_interval=10"]
    sweep = Sweep(config, str(tmp_path / "sweeps"), "older", overrides, {})
    assert sweep.run(Moment("once Tune has saved a trial running", saved=1)), sweep.outputs
    assert sweep.run(Moment("once Tune has saved a second", saved=2)), sweep.outputs
    folder = tmp_path / "sweeps" / "older"
    for pattern in ("searcher-state-*.pkl", "search_gen_state-*.json"):
        files = sorted(folder.glob(pattern))
        assert len(files) == 2, files  # one per run
        files[-1].unlink()
    assert sweep.run(None, timeout=300), sweep.outputs[-1][-3000:]
    verdict = sweep.verdict(n)
    assert verdict.clean, (verdict, sweep.outputs[-1][-3000:])


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_killed_sweep_resumes_without_losing_or_repeating_trials(tiny_data, tmp_path, workers):
    """Both trial paths: 1 worker trains in the Tune trial, 2 workers are a Ray Train DDP run."""
    n, steps, every = (4, 120, 10) if workers == 1 else (2, 60, 10)
    config = write_sweep_config(tiny_data, tmp_path, n=n, max_steps=steps)
    exp_dir = tmp_path / "sweeps" / "killed"
    args = [
        sys.executable,
        "-m",
        "experiments",
        "sweep",
        str(config),
        "--name",
        "killed",
        "--storage",
        str(tmp_path / "sweeps"),
        "--set",
        "sweep.grace_tokens=100000000",
        "--set",
        f"train.eval_interval={every}",
        "--set",
        f"resources.workers={workers}",
    ]
    before = kill_when_interrupted(args, exp_dir, steps, every)
    interrupted = {tid: recs for tid, recs in before.items() if recs[-1]["step"] < steps}
    assert any(recs[-1]["step"] >= 2 * every for recs in interrupted.values()), before

    proc = run_cli("resume", str(exp_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = trial_records(exp_dir)
    assert len(after) == n, sorted(after)
    assert all(recs[-1]["step"] == steps for recs in after.values()), after
    for tid, recs in interrupted.items():
        if recs[-1]["step"] < 2 * every:
            continue  # it may not have had a checkpoint committed yet
        resumed = [r for r in after[tid] if r.get("resumed_from", 0) > 0]
        assert resumed, (
            tid,
            [(r["step"], r.get("resumed_from")) for r in recs],
            [(r["step"], r.get("resumed_from")) for r in after[tid]],
        )
        # From its newest checkpoint: not from step 0, and not before the last one Tune wrote
        # down. The trial may have written newer ones after the last report Tune wrote down
        # (its process runs on while the driver is stopped for the check, and a DDP run reports
        # through a queue): a resume takes the newest on storage.
        assert 0 < resumed[0]["resumed_from"] < steps, (recs[-1], resumed[0])
        assert resumed[0]["resumed_from"] >= recs[-1]["step"] - 3 * every, (recs[-1], resumed[0])
    assert_resumed_study(study_rows(exp_dir), after)


def test_resumed_sweep_past_its_budget_ends_each_trial_once(tiny_data, tmp_path):
    """`sweep.budget` counts from the sweep's start across a kill and a resume: a budget of 2.5
    trials' tokens, one trial at a time, killed once a trial has ended, ends after the resume
    with two trials completed and the third cut (a resume that forgot the tokens trained before
    the kill would complete a third). The cut trial is ended (console line, `end` event) once,
    and a trial that ended before the kill is not announced or ended again."""
    from experiments.results import load_trials

    steps = 240
    full = 4 * 32 * steps  # tokens per trial: batch 4 x seq_len 32 x steps
    config = write_sweep_config(
        tiny_data,
        tmp_path,
        n=4,
        max_steps=steps,
        sweep_keys=f'max_concurrent = 1\nbudget = "{full * 5 // 2} tokens"',
    )
    exp_dir = tmp_path / "sweeps" / "late"
    args = [sys.executable, "-m", "experiments", "sweep", str(config), "--name", "late"]
    args += ["--storage", str(tmp_path / "sweeps"), "--set", "sweep.grace_tokens=100000000"]
    args += ["--set", "train.eval_interval=20"]

    def ended_and_saved_within_budget() -> bool:
        """Tune's saved state holds the trials that have ended, and no trial ended since: one or
        two of them (the budget ends the third)."""
        told = {e["trial_id"] for e in read_events(exp_dir) if e["event"] == "end"}
        terminated = {tid for tid, (status, _) in saved_trials(exp_dir).items() if status == "TERMINATED"}
        return 0 < len(told) < 3 and told == terminated

    kill_when(args, ended_and_saved_within_budget, "a trial ended and Tune saved it")
    ended_before = {e["trial_id"] for e in read_events(exp_dir) if e["event"] == "end"}
    proc = run_cli("resume", str(exp_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    Path("/tmp/resume33.log").write_text(proc.stdout + proc.stderr)  # DEBUG
    import shutil

    shutil.copytree(exp_dir, "/tmp/resume33_exp", dirs_exist_ok=True)  # DEBUG
    trials = load_trials(exp_dir)
    statuses = sorted((t["status"], t["tokens"]) for t in trials)
    assert [s for s, _ in statuses] == ["completed", "completed", "cut by budget"], statuses
    assert full / 2 <= statuses[-1][1] < full, statuses
    assert "cut by the sweep budget" in proc.stdout, (ended_before, proc.stdout[-4000:])
    events = read_events(exp_dir)
    ends = [e["trial_id"] for e in events if e["event"] == "end"]
    # A trial started after Tune's last snapshot before the kill runs on under a new Tune trial.
    continued = {e["trial_id"] for e in events if e["event"] == "continued"}
    started = {e["trial_id"] for e in events if e["event"] == "start"} - continued
    # Each trial that started ended once.
    assert sorted(ends) == sorted(started) == sorted(t["trial_id"] for t in trials), (
        ends,
        sorted(started),
        [(t["trial_id"], t["status"], t["tokens"]) for t in trials],
    )
    for tid in ended_before:
        assert f"trial {tid} " not in proc.stdout, tid


def without_exit_noise(output: str) -> str:
    """`output` without what Python prints for an exception it ignores while a Ray worker process
    is being ended at the sweep's end ("Exception ignored in: <function WeakSet...._remove>",
    its traceback, "SystemExit: 1"): Ray's shutdown of a process, not a failed trial."""
    kept, left = [], 0  # left: lines still to leave out of an ignored exception (at most 20)
    for line in output.splitlines():
        if "Exception ignored in" in line:
            left = 20
        if not left:
            kept.append(line)
        else:
            left = 0 if "SystemExit" in line else left - 1
    return "\n".join(kept)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("sweep.space.lr={ loguniform = [1e-2, 1e-3] }", "range [0.01, 0.001] is empty"),
        ("sweep.space.lr={ uniform = [0.0, 1e-3] }", "learning rate must be > 0"),
        ("sweep.space.lrr={ uniform = [0.1, 0.2] }", "not a config key that can be searched"),
        ("resources.gpus_per_worker=1", "needs"),
        ("optim.warmup=0.5", "lies outside its sweep.space range"),
        ("sweep.space.batch_size={ choice = [4, 0] }", "train.batch_size=0 must be > 0"),
        ('sweep.budget="20 tokens"', "is spent by one trial's first report (512 tokens"),
        ('sweep.budget="x tokens"', "is not a number of tokens"),
        ('sweep.budget="-5 tokens"', "must be a positive, finite number of tokens"),
    ],
)
def test_bad_sweep_configs_are_one_line(tiny_data, tmp_path, override, needle):
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
    env = {"GPTRUN_RESOURCE_WAIT_S": "1"}
    proc = run_cli(
        "sweep", str(config), "--storage", str(tmp_path / "s"), "--set", override, env=env, timeout=120
    )
    assert_user_error(proc, needle)


def test_a_sampled_value_the_config_refuses_fails_that_trial_with_its_reason(tiny_data, tmp_path):
    """A sampled beta2 >= 1 is refused by the config inside the trial: that trial reports its
    reason and a bad score (COMPLETE in the study, where TPE learns from it) instead of a Tune
    ERROR with a traceback; the others run, and the report compares them without it. (A range:
    a `choice` value the config refuses is refused before the sweep starts, see test_transfer.)"""
    from experiments.ray_train import diverged_loss
    from experiments.results import load_trials

    config = write_sweep_config(
        tiny_data, tmp_path, n=4, max_steps=8, tail="beta2 = { uniform = [0.9, 1.4] }\n"
    )
    storage = tmp_path / "sweeps"
    proc = run_cli("sweep", str(config), "--name", "beta2", "--storage", str(storage), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    exp_dir = storage / "beta2"
    trials = load_trials(exp_dir)
    bad = [t for t in trials if t["config"]["optim.beta2"] >= 1]
    assert bad and len(bad) < len(trials), [t["config"] for t in trials]
    for t in bad:
        assert t["status"] == "refused" and "beta2" in t["reason"], t
        assert not (Path(t["path"]) / "error.txt").exists(), t["path"]  # not a Tune ERROR
        assert f"trial {t['trial_id']} refused: " in proc.stdout
    assert "Traceback" not in without_exit_noise(proc.stdout + proc.stderr)
    study = study_values(f"sqlite:///{exp_dir / 'optuna.db'}", "beta2")
    cfg = load_experiment(exp_dir / "gptrun.toml")
    assert all(study[t["trial_id"]] == ("COMPLETE", diverged_loss(cfg), {}) for t in bad), study

    report = run_cli("report", str(exp_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    compared = len(trials) - len(bad)  # the failed trials have no loss to compare
    assert f"(the most all reached): {compared} trials\n" in report.stdout, report.stdout


@pytest.mark.slow
def test_ddp_trial_stopped_by_asha_is_not_an_error(tiny_data, tmp_path, shared_ray):
    """ASHA stopping a 2-worker trial aborts its Ray Train run inside the Tune trial: that is a
    stop, not a failure to report (no `report ... outside a Tuner` warning, no error status).
    One trial at a time, on any number of cores: the second meets ASHA's rung after the first
    (the baseline) and, worse there, is stopped. The sweep starts a local Ray of its own beside
    another one on the machine (`shared_ray`): Ray Train's placement-group cleaner must still
    find its own cluster and give the first trial's CPUs back, or the second trial waits for
    them until the timeout ("Found multiple active Ray instances")."""
    from experiments.results import load_trials

    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=16, sweep_keys="max_concurrent = 1")
    storage = tmp_path / "sweeps"
    proc = run_cli(
        "sweep", str(config), "--name", "ddp", "--storage", str(storage), "--set", "resources.workers=2",
        timeout=600,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "stopped early by ASHA" in proc.stdout, proc.stdout[-4000:]
    assert "is meant to only be called inside" not in output
    assert sorted(t["status"] for t in load_trials(storage / "ddp")) == ["completed", "stopped early"]


def test_an_sft_sweep_over_lr_runs_from_a_pretrained_checkpoint(chat_data, pretrained, tmp_path):
    """SFT in a sweep: every trial starts from `train.init_from` and learns the assistant turns;
    best.toml keeps the stage and the checkpoint, ready to train."""
    from experiments.results import load_trials

    config = write_sweep_config(chat_data, tmp_path, n=3, max_steps=8, sweep_keys="max_concurrent = 1")
    storage = tmp_path / "sweeps"
    proc = run_cli(
        "sweep", str(config), "--name", "sft", "--storage", str(storage), "--set", 'train.stage="sft"',
        "--set", f'train.init_from="{pretrained}"', "--set", "lora.rank=4", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = load_trials(storage / "sft")
    assert len(trials) == 3 and all(t["status"] in ("completed", "stopped early") for t in trials), trials
    best = (storage / "sft" / "best.toml").read_text()
    assert 'stage = "sft"' in best and str(pretrained) in best and "rank = 4" in best


def test_a_trial_tune_never_saved_continues_from_its_checkpoint(tiny_data, tmp_path, monkeypatch):
    """Tune told to save its state once an hour: the driver is killed once the second trial has
    written a checkpoint that Tune's saved state does not know of. The resume runs that trial's
    values under a new Tune trial from that checkpoint (`NewestCheckpoints`, `continues` in the
    study), says so, and every trial that started is ended or continued exactly once."""
    from experiments.record import read_records
    from experiments.results import load_trials
    from gptcore.checkpoint import load_checkpoint

    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=120, sweep_keys="max_concurrent = 1")
    exp_dir = tmp_path / "sweeps" / "unsaved"
    args = [sys.executable, "-m", "experiments", "sweep", str(config), "--name", "unsaved"]
    args += ["--storage", str(tmp_path / "sweeps"), "--set", "sweep.grace_tokens=100000000"]
    args += ["--set", "train.eval_interval=20", "--set", "train.checkpoint_interval=20"]
    unsaved: list[str] = []

    def unsaved_trial_has_a_checkpoint() -> bool:
        """A trial folder Tune's saved state does not know of: with the driver stopped, Tune
        cannot save it, while the trial's process goes on to write its first checkpoint."""
        saved = saved_trials(exp_dir)
        new = [f for f in exp_dir.glob("trial_*") if saved and f.name.removeprefix("trial_") not in saved]
        deadline = time.monotonic() + 60
        while new and time.monotonic() < deadline:
            if list(new[0].glob("checkpoint_*/checkpoint.pt")):
                unsaved.append(new[0].name.removeprefix("trial_"))
                return True
            time.sleep(0.2)
        return False

    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "3600")
    kill_when(args, unsaved_trial_has_a_checkpoint, "a trial Tune never saved wrote a checkpoint")
    (old_id,) = unsaved
    newest = max((exp_dir / f"trial_{old_id}").glob("checkpoint_*/checkpoint.pt"))
    newest_step = load_checkpoint(newest)["step"]
    monkeypatch.delenv("TUNE_GLOBAL_CHECKPOINT_S")
    proc = run_cli("resume", str(exp_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    records = list(read_records(f"sqlite:///{exp_dir / 'optuna.db'}", exp_dir.name).values())
    (moved,) = [r for r in records if r.continues]
    assert moved.continues == [old_id] and moved.tune_id != old_id and moved.status == "completed"
    rows = trial_records(exp_dir)[moved.tune_id]
    assert rows[0]["resumed_from"] == newest_step, (newest_step, rows[0])
    assert f"trial {moved.tune_id} runs the values of trial {old_id}" in proc.stdout
    assert {t["trial_id"] for t in load_trials(exp_dir)} == {r.tune_id for r in records}
    events = read_events(exp_dir)
    started = {e["trial_id"] for e in events if e["event"] == "start"}
    continued = {e["trial_id"]: e["as"] for e in events if e["event"] == "continued"}
    ends = [e["trial_id"] for e in events if e["event"] == "end"]
    assert continued == {old_id: moved.tune_id}
    assert sorted(ends) == sorted(started - set(continued)), (ends, started, continued)
