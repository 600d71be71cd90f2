"""The backends a team uses, for real: the Optuna study on a PostgreSQL server (started by this
module, one per module), W&B runs written offline, and optuna-dashboard serving the study.

Two Ray sweeps share the server: "team" (6 trials, one at a time, logged to W&B offline) and
"killed" (SIGKILLed mid-trial, then resumed). Bad storage URLs are checked before Ray starts.
The password reaches the sweeps as PGPASSWORD; written into a URL instead, gptrun moves it there
as it reads the config (`experiments.credentials`), and it is in no file of the sweep."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from experiments.study_db import dashboard_command, rdb_storage, shown_url
from gptcore.errors import UserError
from tests.conftest import assert_user_error, run_cli, study_trials, write_sweep_config
from tests.postgres import PASSWORD, Postgres, postgres_server
from tests.test_cluster import free_port
from tests.test_sweep import (
    assert_asha_stops_pruned,
    assert_resumed_study,
    kill_when_interrupted,
    trial_records,
)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """The module's server; its password in PGPASSWORD for every command the tests run."""
    with postgres_server() as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        yield server


def wandb_env(folder: Path) -> dict[str, str]:
    """W&B offline and quiet, its caches in `folder`: nothing may reach the network."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_CACHE_DIR": str(folder / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(folder / "wandb-config"),
        "WANDB_DATA_DIR": str(folder / "wandb-data"),
    }


@pytest.fixture(scope="module")
def team_sweep(postgres: Postgres, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep as a team runs it: the study on the server, the trials in W&B (offline)."""
    folder = tmp_path_factory.mktemp("team")
    # One trial at a time, as in the sqlite sweep of conftest: ASHA's decisions are the same on
    # every run, and its first 6 trials include stopped and completed ones.
    config = write_sweep_config(
        tiny_data,
        folder,
        n=6,
        max_steps=24,
        sweep_keys=f'max_concurrent = 1\nstorage_url = "{postgres.url()}"',
        tail='\n[tracking]\nwandb_project = "gptrun-tests"\n',
    )
    proc = run_cli(
        "sweep", str(config), "--name", "team", "--storage", str(folder / "sweeps"),
        env=wandb_env(folder), timeout=600,
    )  # fmt: skip
    (folder / "sweep.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"study {postgres.url()}" in proc.stdout, proc.stdout[:2000]
    return folder / "sweeps" / "team"


def test_postgres_study_holds_every_trial_and_asha_stops_are_pruned(team_sweep, postgres):
    from experiments.results import load_trials

    trials = load_trials(team_sweep)
    statuses = sorted(t["status"] for t in trials)
    assert len(trials) == 6 and "stopped early" in statuses and "completed" in statuses, statuses
    assert_asha_stops_pruned(trials, study_trials(postgres.url(), "team"))
    assert not (team_sweep / "optuna.db").exists()  # the study is on the server, not beside it


def files_holding(secret: bytes, *folders: Path) -> list[str]:
    """The files under `folders` whose bytes hold `secret`, opened where compressed (a zip such as
    a torch checkpoint, gzip) or pickled as text."""
    found = []
    for path in (p for folder in folders for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blobs = [data]
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                blobs += [archive.read(name) for name in archive.namelist()]
        if data[:2] == b"\x1f\x8b":
            blobs.append(gzip.decompress(data))
        if any(secret in blob for blob in blobs):
            found.append(str(path))
    return found


def study_snapshot(url: str, name: str) -> list[tuple[Any, ...]]:
    import optuna

    study = optuna.load_study(study_name=name, storage=url)
    return [(t.number, t.state, t.value, t.params, t.intermediate_values, t.user_attrs) for t in study.trials]


def test_killed_sweep_beside_another_resumes_without_losing_or_repeating(
    team_sweep, postgres, tiny_data, tmp_path
):
    """A second sweep in the same database, SIGKILLed mid-trial and resumed: each of its trials
    is in its own study once; the first sweep's study is untouched, and its name is refused.
    Its URL holds the password: the sweep, the resume (reading the saved config, which has none:
    PGPASSWORD has it) and the report work, and the password is in none of their files."""
    url = postgres.url()
    before_team = study_snapshot(url, "team")
    n, steps, every = 4, 120, 10  # as the sqlite kill test of test_sweep: a kill lands mid-trial
    planted = postgres.url(password=PASSWORD)
    config = write_sweep_config(
        tiny_data, tmp_path, n=n, max_steps=steps, sweep_keys=f'storage_url = "{planted}"'
    )
    storage = tmp_path / "sweeps"
    args = [sys.executable, "-m", "experiments", "sweep", str(config), "--name", "killed"]
    args += ["--storage", str(storage), "--set", "sweep.grace_tokens=100000000"]
    before = kill_when_interrupted(args, storage / "killed", steps, every)
    assert any(recs[-1]["step"] < steps for recs in before.values()), before  # killed mid-trial

    proc = run_cli("resume", str(storage / "killed"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = trial_records(storage / "killed")
    assert len(after) == n and all(recs[-1]["step"] == steps for recs in after.values()), after
    assert_resumed_study(study_trials(url, "killed"), after)
    assert study_snapshot(url, "team") == before_team
    report = run_cli("report", str(storage / "killed"), "--out", str(tmp_path / "report"), timeout=300)
    assert report.returncode == 0, report.stdout[-4000:] + report.stderr[-4000:]
    assert PASSWORD not in proc.stdout + proc.stderr + report.stdout + report.stderr
    assert not files_holding(PASSWORD.encode(), storage, tmp_path / "report")

    other = run_cli("sweep", str(config), "--name", "team", "--storage", str(tmp_path / "elsewhere"))
    assert_user_error(other, "already holds a study named 'team'", "--restart")
    assert study_snapshot(url, "team") == before_team


@pytest.mark.parametrize("case", ["bad url", "refused", "wrong password", "two passwords"])
def test_bad_storage_url_is_one_line_before_ray_starts(postgres, tiny_data, tmp_path, case):
    url, env, needle = {
        "bad url": ("postgresql://gptrun@127.0.0.1:port/postgres", {}, "not a database URL"),
        "refused": (postgres.url(port=free_port()), {}, "Connection refused"),
        "wrong password": (postgres.url(), {"PGPASSWORD": "hunter2"}, "password authentication failed"),
        "two passwords": (postgres.url(password="hunter2"), {}, "$PGPASSWORD holds another"),
    }[case]
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8, sweep_keys=f'storage_url = "{url}"')
    ray_tmp = tmp_path / "ray"
    proc = run_cli(
        "sweep", str(config), "--storage", str(tmp_path / "sweeps"), env={"RAY_TMPDIR": str(ray_tmp), **env}
    )
    shown = "holds a password" if case == "two passwords" else shown_url(url)
    assert_user_error(proc, f"sweep.storage_url {shown}", needle)
    assert "hunter2" not in proc.stderr  # a password is never printed
    assert not ray_tmp.exists() and not (tmp_path / "sweeps").exists()  # no Ray, nothing written


def test_missing_driver_names_the_extra(monkeypatch, postgres):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if gptrun[postgres] were not installed
    with pytest.raises(
        UserError, match=r"needs the database driver 'psycopg': pip install 'gptrun\[postgres\]'"
    ):
        rdb_storage(postgres.url())


def test_dashboard_command_hides_a_password():
    assert (
        dashboard_command("sqlite:////s/my sweep/optuna.db")
        == "optuna-dashboard 'sqlite:////s/my sweep/optuna.db'"
    )
    command = dashboard_command("postgresql://u:secret@db:5432/studies")
    assert command.startswith("optuna-dashboard 'postgresql://u:***@db:5432/studies'  # password hidden")
    assert "secret" not in command


# ------------------------------------------------------------------ W&B offline


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records of an offline run's `.wandb` file. W&B writes a LevelDB-style log: a
    7-byte file header, then 32 KiB blocks of chunks [crc:4][length:2][type:1][data]; a record is
    one FULL chunk (type 1) or FIRST, MIDDLE..., LAST (2, 3..., 4); a block's tail shorter than a
    chunk header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block = run_file.read_bytes(), 32768
    assert raw[:7] == b":W&B\xe1\xbe\x00", raw[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", raw[pos + 4 : pos + 7])
        if kind == 0:  # zeroed space at the end of the file
            break
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(update: Any) -> dict[str, Any]:
    return {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in update}


def test_wandb_offline_writes_one_run_per_trial_with_params_and_metrics(team_sweep):
    runs = sorted((team_sweep / "wandb").glob("offline-run-*"))
    reports = trial_records(team_sweep)
    assert sorted(run.name.rsplit("-", 1)[1] for run in runs) == sorted(reports), runs
    for run in runs:
        trial_id = run.name.rsplit("-", 1)[1]
        records = wandb_records(run / f"run-{trial_id}.wandb")
        kinds = [r.WhichOneof("record_type") for r in records]
        assert "exit" in kinds, kinds  # the run was finished, not cut off
        header = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert (header.project, header.run_group) == ("gptrun-tests", "team")
        config = items(header.config.update)
        for key, value in reports[trial_id][0]["config"].items():  # the trial's sampled values
            assert config[key] == pytest.approx(value), (key, config)
        history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
        logged = [h for h in history if "val_loss" in h]
        reported = [r for r in reports[trial_id] if "val_loss" in r]
        assert logged and [h["tokens"] for h in logged] == [r["tokens"] for r in reported], (logged, reported)
        assert [h["val_loss"] for h in logged] == pytest.approx([r["val_loss"] for r in reported])


def test_wandb_online_without_a_login_is_one_line(tiny_data, tmp_path, monkeypatch):
    config = write_sweep_config(
        tiny_data, tmp_path, n=2, max_steps=8, tail='\n[tracking]\nwandb_project = "gptrun-tests"\n'
    )
    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    env = {k: v for k, v in wandb_env(tmp_path).items() if k != "WANDB_MODE"}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"))
    proc = run_cli("sweep", str(config), "--storage", str(tmp_path / "sweeps"), env=env)
    assert_user_error(proc, "wandb_project needs a W&B login", "WANDB_MODE=offline")


# ------------------------------------------------------------------ optuna-dashboard


@contextlib.contextmanager
def started(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get_json(url: str, proc: subprocess.Popen, timeout: float = 60) -> Any:
    """GET `url` once the server answers; fail with its output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"optuna-dashboard did not serve {url}: {proc.communicate()[0][-3000:]}")
            time.sleep(0.5)


def test_report_prints_the_dashboard_command_that_serves_the_study(team_sweep, postgres, tmp_path):
    proc = run_cli("report", str(team_sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next((s for s in proc.stdout.splitlines() if s.startswith("study: ")), None)
    assert line == f"study: optuna-dashboard {postgres.url()}", proc.stdout[-3000:]
    assert (tmp_path / "report" / "report.html").is_file()

    command = shlex.split(line.removeprefix("study: "))
    command[0] = str(Path(sys.executable).parent / command[0])  # the venv's console script
    port = free_port()
    with started([*command, "--host", "127.0.0.1", "--port", str(port), "--quiet"], dict(os.environ)) as srv:
        studies = get_json(f"http://127.0.0.1:{port}/api/studies", srv)["study_summaries"]
        assert {"team", "killed"} >= {s["study_name"] for s in studies} >= {"team"}, studies
        study_id = next(s["study_id"] for s in studies if s["study_name"] == "team")
        served = get_json(f"http://127.0.0.1:{port}/api/studies/{study_id}", srv)["trials"]
    rows = dict(study_trials(postgres.url(), "team"))
    got = {}
    for trial in served:
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        got[attrs["tune_trial_id"]] = trial["state"].upper()
    assert got == rows, (got, rows)


def test_passwords_in_urls_reach_no_file_of_a_sweep_its_confirm_and_report(postgres, tiny_data, tmp_path):
    """Both URLs of a sweep hold the password: the study's (`sweep.storage_url`) and MLflow's
    (`tracking.mlflow_uri`, its runs in a database of the same server). The sweep, `confirm`
    (which reads the saved config, without it) and `report` run, with PGPASSWORD set as a
    later command needs; the password is in none of their files, printed lines or checkpoints."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(postgres.url().replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as db:
        db.execute(sqlalchemy.text("CREATE DATABASE runs"))
    engine.dispose()
    planted = postgres.url(password=PASSWORD)
    mlflow = planted.replace("postgresql://", "postgresql+psycopg://").replace("/postgres", "/runs")
    config = write_sweep_config(
        tiny_data,
        tmp_path,
        n=2,
        max_steps=16,
        sweep_keys=f'storage_url = "{planted}"\nmax_concurrent = 1',
        tail=f'\n[tracking]\nmlflow_uri = "{mlflow}"\n',
    )
    storage = tmp_path / "sweeps"
    outputs = []
    for args in (
        ["sweep", str(config), "--name", "secret", "--storage", str(storage)],
        ["confirm", str(storage / "secret"), "--top", "1", "--seeds", "2"],
        ["report", str(storage / "secret"), "--out", str(tmp_path / "report")],
    ):
        proc = run_cli(*args, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        outputs.append(proc.stdout + proc.stderr)
    assert PASSWORD not in "".join(outputs)
    assert (storage / "secret" / "noise.json").is_file()  # confirm ran its seeds
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow.replace(f":{PASSWORD}@", "@"))  # the password from PGPASSWORD
    experiment = client.get_experiment_by_name("secret")
    assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 2
    assert not files_holding(PASSWORD.encode(), storage, tmp_path / "report")
