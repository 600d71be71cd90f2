"""`--restart` deletes only once every check has passed, and never a study that the experiment
did not create unless asked (`--replace-study`). The clusters here are dead addresses: a check
that fails after the deletion would leave the user with nothing."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import optuna
import pytest

from tests.conftest import assert_user_error, run_cli, write_sweep_config


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def teammates_study(url: str, name: str) -> None:
    """A study of `name` with one finished trial, made by someone else's sweep."""
    study = optuna.create_study(study_name=name, storage=url)
    study.enqueue_trial({"x": 1.0})
    study.optimize(lambda t: t.suggest_float("x", 0, 2), n_trials=1)


def study_names(url: str) -> set[str]:
    return {s.study_name for s in optuna.get_all_study_summaries(url)}


def sweep_args(config: Path, storage: Path, url: str, *extra: str) -> list[str]:
    return [
        "sweep",
        str(config),
        "--name",
        "shared",
        "--storage",
        str(storage),
        "--set",
        f'sweep.storage_url="{url}"',
        *extra,
    ]


def test_restart_refuses_to_delete_a_study_it_did_not_create(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    url = f"sqlite:///{tmp_path / 'team.db'}"
    teammates_study(url, "shared")
    storage = tmp_path / "sweeps"
    proc = run_cli(*sweep_args(config, storage, url, "--restart"), timeout=120)
    assert_user_error(proc, "did not create", "--replace-study")
    assert "shared" in study_names(url) and not storage.exists()


def test_restart_deletes_nothing_before_the_cluster_answers(tiny_data, tmp_path):
    """The experiment's own study (its sweep.json names it) and folder stay as they were when the
    cluster does not answer."""
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    url = f"sqlite:///{tmp_path / 'team.db'}"
    teammates_study(url, "shared")
    exp_dir = tmp_path / "sweeps" / "shared"
    exp_dir.mkdir(parents=True)
    (exp_dir / "sweep.json").write_text(json.dumps({"study_url": url, "study_name": "shared"}))
    address = dead_address()
    args = sweep_args(config, exp_dir.parent, url, "--restart", "--address", address)
    assert_user_error(run_cli(*args, timeout=120), f"nothing answers at --address {address}")
    assert len(optuna.load_study(study_name="shared", storage=url).trials) == 1
    assert sorted(p.name for p in exp_dir.iterdir()) == ["sweep.json"]


def test_replace_study_without_restart_is_one_line(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    proc = run_cli("sweep", str(config), "--storage", str(tmp_path / "s"), "--replace-study")
    assert_user_error(proc, "--replace-study goes with --restart")


def test_confirm_restart_keeps_the_old_confirm_until_the_cluster_answers(finished_sweep, tmp_path):
    copy = tmp_path / "finished"
    shutil.copytree(finished_sweep, copy)
    before = sorted(p.name for p in (copy / "confirm").iterdir())
    address = dead_address()
    proc = run_cli("confirm", str(copy), "--top", "1", "--seeds", "3", "--restart", "--address", address)
    assert_user_error(proc, f"nothing answers at --address {address}")
    assert sorted(p.name for p in (copy / "confirm").iterdir()) == before


def test_a_name_taken_while_the_sweep_waited_is_refused_not_deleted(tiny_data, tmp_path):
    """Between `plan_sweep`'s check and the first write, the wait for the cluster can last
    minutes: a teammate's sweep of the same name made meanwhile is refused, and kept whole."""
    from experiments.sweep import claim_name, plan_sweep
    from gptcore.errors import UserError

    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=4)
    storage = tmp_path / "sweeps"
    plan = plan_sweep(str(config), [], name="race", storage=str(storage), restart=False, address="x")
    theirs = storage / "race" / "gptrun.toml"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("their sweep\n")
    with pytest.raises(UserError, match="was created while this sweep waited"):
        claim_name(plan)
    assert theirs.read_text() == "their sweep\n"
    shutil.rmtree(storage / "race")
    claim_name(plan)  # a free name is taken
    assert (storage / "race").is_dir()
