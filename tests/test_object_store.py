"""Sweeps whose state lives in object storage, on a real S3-compatible server: moto's server on a
free loopback port, which pyarrow (and so Ray Tune) reaches through AWS_ENDPOINT_URL.

A sweep with `--storage s3://...` whose driver is SIGKILLed mid-sweep is finished by
`gptrun resume s3://...` with no trial lost or repeated, `gptrun report s3://...` writes its page
locally, `--restart` deletes under the URI; a missing bucket or an endpoint that does not answer
is one line, exit 2, before Ray starts, with nothing written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    REPO,
    assert_user_error,
    free_ports,
    mid_trial_checkpoints,
    resume_checkpoints,
    run_cli,
    write_sweep_config,
)
from tests.test_sweep import assert_resumed_study, study_rows

BUCKET = "gptrun-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A moto S3 server with one bucket; the environment a client needs to reach it (fake
    credentials, no instance metadata lookups, a cache of its own for the working copies)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "GPTRUN_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
    }
    s3_client(env).create_bucket(Bucket=BUCKET)
    try:
        yield env
    finally:
        server.stop()


def s3_client(env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def keys(env: dict[str, str], prefix: str) -> list[str]:
    """Every object key under `prefix` in the test bucket."""
    client = s3_client(env)
    found: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found += [obj["Key"] for obj in page.get("Contents", [])]
    return found


def result_rows(env: dict[str, str], prefix: str) -> dict[str, list[dict]]:
    """Every report of every trial, from the trials' result.json objects."""
    client = s3_client(env)
    rows: dict[str, list[dict]] = {}
    for key in keys(env, prefix):
        if key.endswith("/result.json") and "/runs/" not in key:
            text = client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
            if records:
                rows[records[0]["trial_id"]] = records
    return rows


def test_missing_bucket_is_one_line_and_writes_nothing(s3, tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    proc = run_cli("sweep", str(config), "--storage", "s3://no-such-bucket/sweeps", env=s3, timeout=120)
    assert_user_error(proc, "bucket 'no-such-bucket' does not exist")
    assert not (Path(s3["GPTRUN_CACHE_DIR"]) / "remote").exists()
    for command in ("report", "resume"):
        proc = run_cli(command, "s3://no-such-bucket/sweeps/x", env=s3, timeout=120)
        assert_user_error(proc, "bucket 'no-such-bucket' does not exist")


def test_unreachable_endpoint_is_one_line(s3, tiny_data, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    env = {**s3, "AWS_ENDPOINT_URL": dead}
    proc = run_cli("sweep", str(config), "--storage", f"s3://{BUCKET}/sweeps", env=env, timeout=120)
    assert_user_error(proc, "cannot reach the object store")


@pytest.mark.slow  # GCS's client waits out its own retries: 11-16 s a command (system tier)
@pytest.mark.parametrize("command", ["sweep", "report", "resume"])
def test_gs_without_google_credentials_is_one_line_and_exits(tiny_data, tmp_path, command):
    """Without credentials GCS's client retries for minutes, and a probe thread left running
    kept the process from exiting: now the probe has its own bound and the line names Google's
    credentials (not AWS_ENDPOINT_URL). `run_cli`'s timeout is the bound the test holds it to."""
    env = {
        "HOME": str(tmp_path),  # no gcloud configuration
        "GOOGLE_APPLICATION_CREDENTIALS": "",
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
        "GPTRUN_CACHE_DIR": str(tmp_path / "cache"),
    }
    where = "gs://gptrun-no-credentials/sweeps"
    if command == "sweep":
        config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
        args = ["sweep", str(config), "--storage", where]
    else:
        args = [command, f"{where}/x"]
    proc = run_cli(*args, env=env, timeout=90)
    assert_user_error(proc, "no usable Google credentials", "GOOGLE_APPLICATION_CREDENTIALS")
    assert "AWS_ENDPOINT_URL" not in proc.stderr
    assert not (tmp_path / "cache" / "remote").exists()


@pytest.mark.slow  # waits out the 30 s bound it checks (system tier)
def test_gs_whose_metadata_server_never_answers_exits_within_the_bound(tmp_path):
    """Off Google Cloud, where the metadata server's address swallows connections (a firewall
    that drops packets), GCS's retry limit does not bound the credential lookup: the outer bound
    ends the wait, and the probe thread, still inside pyarrow, must not hold the exit (an
    executor's thread is joined at exit: the process never ended)."""
    from experiments.remote import CHECK_TIMEOUT_S

    with socket.create_server(("127.0.0.1", 0), backlog=64) as dark:  # connects, never answers
        env = {
            "HOME": str(tmp_path),
            "GOOGLE_APPLICATION_CREDENTIALS": "",
            "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
            "GCE_METADATA_ROOT": f"127.0.0.1:{dark.getsockname()[1]}",
            "GPTRUN_CACHE_DIR": str(tmp_path / "cache"),
        }
        start = time.monotonic()
        proc = run_cli("report", "gs://gptrun-dark-metadata/sweeps/x", env=env, timeout=CHECK_TIMEOUT_S + 30)
    assert_user_error(proc, f"did not answer within {CHECK_TIMEOUT_S:g}s", "GOOGLE_APPLICATION_CREDENTIALS")
    assert "AWS_ENDPOINT_URL" not in proc.stderr and time.monotonic() - start < CHECK_TIMEOUT_S + 20


@pytest.mark.parametrize("command", ["sweep", "report"])
def test_a_scheme_other_than_s3_or_gs_is_one_line(tiny_data, tmp_path, command):
    """pyarrow opens more schemes than gptrun is tested with; its Azure client, finding no
    credentials, aborted the process (exit 134, no error to catch)."""
    env = {"HOME": str(tmp_path), "GPTRUN_CACHE_DIR": str(tmp_path / "cache")}
    where = "abfs://sweeps@account.dfs.core.windows.net/sweeps"
    if command == "sweep":
        config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
        args = ["sweep", str(config), "--storage", where]
    else:
        args = [command, f"{where}/x"]
    proc = run_cli(*args, env=env, timeout=120)
    assert_user_error(proc, "s3:// or gs://", "not abfs://")
    assert not (tmp_path / "cache").exists()


def saved_states(env: dict[str, str], prefix: str) -> list[str]:
    """The texts of Tune's experiment states under `prefix` (what a resume reads)."""
    client = s3_client(env)
    found = [k for k in keys(env, prefix) if k.rpartition("/")[2].startswith("experiment_state-")]
    return [client.get_object(Bucket=BUCKET, Key=k)["Body"].read().decode() for k in found]


@pytest.mark.slow
def test_sweep_in_s3_survives_a_killed_driver(s3, tiny_data, tmp_path):
    steps, every = 120, 10
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=3, max_steps=steps)
    uri = f"s3://{BUCKET}/sweeps/killed"
    args = ["sweep", str(config), "--name", "killed", "--storage", f"s3://{BUCKET}/sweeps"]
    for item in ("sweep.grace_tokens=100000000", f"train.eval_interval={every}", "sweep.max_concurrent=2"):
        args += ["--set", item]
    driver = subprocess.Popen(
        [sys.executable, "-m", "experiments", *args],
        env={**os.environ, **s3, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:  # until the state Tune uploaded holds an unfinished trial with a checkpoint
        deadline = time.monotonic() + 300
        while not mid_trial_checkpoints(saved_states(s3, "sweeps/killed/"), 2 * every, steps):
            assert driver.poll() is None, "the sweep ended before it was killed"
            assert time.monotonic() < deadline, "no trial got half-way in time"
            time.sleep(0.5)
    finally:  # the driver and the local Ray it started: its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    states = saved_states(s3, "sweeps/killed/")
    interrupted = mid_trial_checkpoints(states, 2 * every, steps)
    before = result_rows(s3, "sweeps/killed/")
    # A driver killed after deleting a checkpoint and before uploading a state that no longer
    # names it leaves a state naming a lost checkpoint (about 1 run in 10 met it): made certain
    # here for the trial that got furthest, whose resume checkpoint is deleted.
    lost_tid = max(interrupted, key=interrupted.get)
    lost = resume_checkpoints(states)[lost_tid].checkpoint.path
    client = s3_client(s3)
    for key in keys(s3, lost.split("/", 1)[1] + "/"):
        client.delete_object(Bucket=BUCKET, Key=key)
    lost_step = interrupted.pop(lost_tid)

    elsewhere = {**s3, "GPTRUN_CACHE_DIR": str(tmp_path / "other-machine")}  # no study there
    proc = run_cli("resume", uri, env=elsewhere, timeout=120)
    assert_user_error(proc, "its Optuna study is optuna.db on the machine that started it")

    proc = run_cli("resume", uri, env=s3, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = result_rows(s3, "sweeps/killed/")
    assert len(after) == 3 and set(before) <= set(after), (sorted(before), sorted(after))
    last = {tid: rows[-1]["step"] for tid, rows in after.items()}
    assert set(last.values()) == {steps}, (last, proc.stdout[-3000:])
    lost_name = lost.rsplit("/", 1)[1]
    assert f"trial {lost_tid}: Tune's saved state named checkpoint {lost_name}, its newest" in proc.stdout
    for needle in ("Could not recover", "Error handling checkpoint"):  # no failed restore or delete
        assert needle not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-6000:]
    resumed = [r["resumed_from"] for r in after[lost_tid] if r.get("resumed_from", 0) > 0]
    assert not resumed or resumed[0] != lost_step, (lost_step, resumed)  # another, or step 0
    for tid, step in interrupted.items():  # continued from its checkpoint, not from step 0
        resumed = [r["resumed_from"] for r in after[tid] if r.get("resumed_from", 0) > 0]
        assert resumed and step <= resumed[0] < steps, (tid, step, resumed)
    assert_resumed_study(
        study_rows(Path(s3["GPTRUN_CACHE_DIR"], "remote/s3", BUCKET, "sweeps/killed")), after
    )
    names = {k.rsplit("/", 1)[-1] for k in keys(s3, "sweeps/killed/")}
    assert {"gptrun.toml", "sweep.json", "events.jsonl", "best.toml"} <= names

    out = tmp_path / "report"
    proc = run_cli("report", uri, "--out", str(out), env=s3, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "report.html").exists() and (out / "trials.csv").exists()
    assert f"s3://{BUCKET}/sweeps/killed/trial_" in (out / "trials.csv").read_text()  # checkpoints

    old = {k for k in keys(s3, "sweeps/killed/") if "/trial_" in k}
    restart = [*args[:1], str(config), "--name", "killed", "--storage", f"s3://{BUCKET}/sweeps"]
    restart += ["--restart", "--set", "sweep.num_samples=1", "--set", "train.max_steps=8"]
    proc = run_cli(*restart, env=s3, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not old & set(keys(s3, "sweeps/killed/"))  # the old trials are gone from the bucket
    assert len(result_rows(s3, "sweeps/killed/")) == 1


@pytest.mark.slow
def test_kill_anywhere_in_s3(s3, tiny_data, tmp_path, monkeypatch):
    """tests/test_sweep.py's kill-anywhere test on the moto server, at the moments where the
    object store's background uploads matter: right after a trial ends, right after ASHA stops
    one, while a checkpoint is written."""
    from benchmarks.kill_anywhere import CHOSEN, Sweep, kill_and_resume

    for key, value in s3.items():  # the harness reads the bucket and the working copy here too
        monkeypatch.setenv(key, value)
    n = 8
    config = write_sweep_config(tiny_data, tmp_path, n=n, max_steps=60)
    overrides = ["train.eval_interval=10", "train.checkpoint_interval=10"]
    sweep = Sweep(config, f"s3://{BUCKET}/sweeps", "anywhere", overrides, s3)
    moments = [m for m in CHOSEN if "ends" in m.name or "ASHA" in m.name or "checkpoint" in m.name]
    missed = kill_and_resume(sweep, moments)
    assert not missed, (missed, sweep.outputs)
    verdict = sweep.verdict(n)
    assert verdict.clean, (verdict, sweep.outputs[-1][-3000:])


def test_a_uri_taken_while_the_sweep_waited_is_refused_not_deleted(s3, tiny_data, tmp_path, monkeypatch):
    """The object-store side of tests/test_restart.py's name race: a sweep of the same name that
    appeared in the bucket after the plan's check is refused, and nothing of it is deleted."""
    from experiments.sweep import claim_name, plan_sweep
    from gptcore.errors import UserError

    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=4)
    storage = f"s3://{BUCKET}/race"
    plan = plan_sweep(str(config), [], name="taken", storage=storage, restart=False, address="x")
    s3_client(s3).put_object(Bucket=BUCKET, Key="race/taken/gptrun.toml", Body=b"theirs")
    with pytest.raises(UserError, match="was created while this sweep waited"):
        claim_name(plan)
    assert keys(s3, "race/taken/") == ["race/taken/gptrun.toml"]


def test_events_are_uploaded_in_batches_and_a_failed_upload_ends_nothing(s3, tmp_path, monkeypatch, capsys):
    """events.jsonl is uploaded at most every few seconds (each upload is the whole file), a
    resume's pull keeps the lines a killed driver had not uploaded yet, and an upload that fails
    is a warning, never an error that would end the sweep."""
    from experiments import remote
    from experiments.experiment import EVENTS_FILE, append_event

    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{BUCKET}/batch/exp"
    folder = remote.open_working_copy(uri, pull=False)
    for i in range(20):
        append_event(folder, {"event": "start", "trial_id": str(i), "unix": 0.0})
    uploaded = remote.read_text(f"{uri}/{EVENTS_FILE}")
    assert uploaded is not None and len(uploaded.splitlines()) == 1  # the first, then a batch later
    remote.open_working_copy(uri, pull=True)  # a resume on this machine: the local lines stay
    assert len((folder / EVENTS_FILE).read_text().splitlines()) == 20
    remote.upload_soon(folder, EVENTS_FILE, now=True)
    assert len(remote.read_text(f"{uri}/{EVENTS_FILE}").splitlines()) == 20

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")  # nothing there
    append_event(folder, {"event": "end", "trial_id": "0", "unix": 0.0})
    remote.upload_soon(folder, EVENTS_FILE, now=True)
    assert "warning: events.jsonl not uploaded" in capsys.readouterr().out
    assert len((folder / EVENTS_FILE).read_text().splitlines()) == 21


def test_an_endpoint_that_stops_answering_holds_the_sweep_within_bounds(s3, tmp_path, monkeypatch, capsys):
    """Events are appended from Tune's callbacks, on the driver's loop. With the endpoint taking
    connections but never answering, an upload gives up within its own bounds (it held each
    event for 99 s), says so once, and the events after it wait for the next try instead of each
    trying again; the next flush once the store answers uploads every line."""
    from experiments import remote
    from experiments.experiment import EVENTS_FILE, append_event

    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{BUCKET}/dark/exp"
    folder = remote.open_working_copy(uri, pull=False)
    with socket.create_server(("127.0.0.1", 0), backlog=64) as dark:  # connects, never answers
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dark.getsockname()[1]}")
        start = time.monotonic()
        for i in range(10):
            append_event(folder, {"event": "start", "trial_id": str(i), "unix": 0.0})
        took = time.monotonic() - start
    assert took < 3 * remote.BOUNDED_TIMEOUT_S * remote.BOUNDED_ATTEMPTS, took
    assert capsys.readouterr().out.count("warning: events.jsonl not uploaded") == 1
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["AWS_ENDPOINT_URL"])
    remote.upload_soon(folder, EVENTS_FILE, now=True)  # the sweep's end
    assert len(remote.read_text(f"{uri}/{EVENTS_FILE}").splitlines()) == 10


def test_of_sweeps_claiming_one_name_at_once_at_most_one_goes_on(s3, tiny_data, tmp_path, monkeypatch):
    """A name in object storage is claimed with an object of one's own, then a listing: of eight
    sweeps claiming one name at the same moment at most one goes on (a second look at the name
    let all eight on), the others leave nothing that takes the name, and once taken it is
    refused."""
    import threading

    from experiments import remote
    from experiments.sweep import claim_name, plan_sweep
    from gptcore.errors import UserError

    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=4)
    plan = plan_sweep(
        str(config), [], name="same", storage=f"s3://{BUCKET}/claims", restart=False, address="x"
    )
    start, won = threading.Barrier(8), []

    def claim() -> None:
        start.wait()
        try:
            claim_name(plan)
            won.append(True)
        except UserError:
            won.append(False)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 8 and won.count(True) <= 1, won
    claims = [k for k in keys(s3, "claims/same/") if remote.CLAIM_PREFIX in k]
    assert len(claims) == won.count(True) and remote.exists(plan.uri) is any(won)
    if not any(won):  # all eight gave way: the name is still free
        claim_name(plan)
    with pytest.raises(UserError, match="was created while this sweep waited"):
        claim_name(plan)
