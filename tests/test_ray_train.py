"""Ray Train runs on a real local Ray instance: DDP parity, a killed worker, resume, bad input.

One Ray session serves the whole module; the CLI tests that need their own driver process are
the Ctrl-C and dead-address ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments.cluster import job_runtime_env
from experiments.ray_config import load_experiment
from experiments.ray_train import build_trainer, train_on_ray
from gptcore.errors import UserError
from tests.conftest import REPO, assert_user_error, committed_step, run_cli, tiny_config_text


@pytest.fixture(scope="module")
def ray_local():
    import ray

    # The dashboard serves the state API that finds worker pids (kept on localhost). A Ray of the
    # module's own, even beside the session's shared one, with gptrun's runtime_env (its workers
    # are told their cluster: `point_at_own_cluster`).
    ray.init(
        address="local",
        runtime_env=job_runtime_env(),
        num_cpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level="warning",
    )
    yield
    ray.shutdown()


def tiny_cfg(tiny_data, tmp_path, *overrides: str):
    path = tmp_path / "exp.toml"
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    return load_experiment(path, ["train.num_threads=1", "train.precision=fp32", *overrides])


def report_history(result) -> list[dict]:
    frame = result.metrics_dataframe
    return frame.sort_values("step").to_dict("records")


def test_two_workers_match_one_worker_with_the_same_global_batch(ray_local, tiny_data, tmp_path):
    common = ["train.max_steps=6", "train.eval_interval=1", "train.keep_checkpoints=0"]
    one = tiny_cfg(tiny_data, tmp_path, "train.batch_size=8", "resources.workers=1", *common)
    two = tiny_cfg(tiny_data, tmp_path, "train.batch_size=4", "resources.workers=2", *common)
    storage = str(tmp_path / "storage")
    curves = []
    for name, cfg in (("one", one), ("two", two)):
        result = build_trainer(cfg, storage=storage, name=name, max_failures=0).fit()
        curves.append(report_history(result))
    assert [r["step"] for r in curves[0]] == list(range(1, 7))
    assert curves[1][-1]["world_size"] == 2
    for a, b in zip(*curves, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)


def train_worker_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    own = ray.get_runtime_context().gcs_address  # not "the" Ray: the session's shared one runs too
    actors = list_actors(address=own, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.pid for a in actors if "RayTrainWorker" in a.class_name and a.pid]


@pytest.mark.slow  # a DDP kill test: `pytest -m "not slow"` skips it, as the docs say
def test_killed_worker_restarts_from_checkpoint_and_finishes(ray_local, tiny_data, tmp_path):
    cfg = tiny_cfg(
        tiny_data,
        tmp_path,
        "train.max_steps=80",
        "train.eval_interval=5",
        "resources.workers=2",
        "model.n_layer=4",
        "model.d_model=128",
    )
    storage = tmp_path / "storage"
    trainer = build_trainer(cfg, storage=str(storage), name="killed", max_failures=2)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=trainer.fit()))
    thread.start()
    deadline = time.monotonic() + 120
    while committed_step(storage / "killed") < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed_step(storage / "killed") >= 10, "no checkpoint at step 10 was committed"
    pids = train_worker_pids()
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive()
    history = report_history(outcome["result"])
    assert history[-1]["step"] == 80
    restarted = [r for r in history if r["resumed_from"] > 0]
    assert restarted, [(r["step"], r["resumed_from"]) for r in history]
    first_resume = restarted[0]
    assert first_resume["step"] > first_resume["resumed_from"] >= 5
    # The curve continues: after the restart the loss is below where the run started.
    assert history[-1]["val_loss"] < history[0]["val_loss"]


def test_rerun_with_the_same_name_resumes(ray_local, tiny_data, tmp_path, capsys):
    storage = str(tmp_path / "storage")
    first = tiny_cfg(tiny_data, tmp_path, "train.max_steps=8")
    assert train_on_ray(first, address=None, storage=storage, name="again", max_failures=0) == 0
    longer = tiny_cfg(tiny_data, tmp_path, "train.max_steps=12")
    with pytest.raises(UserError, match="8-step run but this config makes 12 steps"):
        train_on_ray(longer, address=None, storage=storage, name="again", max_failures=3)
    longer = tiny_cfg(tiny_data, tmp_path, "train.max_steps=12", "train.extend=true")
    assert train_on_ray(longer, address=None, storage=storage, name="again", max_failures=0) == 0
    out = capsys.readouterr().out
    assert "best checkpoint" in out and "last checkpoint" in out
    from ray.train import Result

    history = report_history(Result.from_path(f"{storage}/again"))
    assert history[-1]["step"] == 12 and history[-1]["resumed_from"] == 8


def test_more_workers_than_the_cluster_fails_fast(ray_local, tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("GPTRUN_RESOURCE_WAIT_S", "2")
    cfg = tiny_cfg(tiny_data, tmp_path, "resources.workers=8")
    start = time.monotonic()
    with pytest.raises(UserError, match="needs 8 CPUs and 0 GPUs but the cluster has 2 CPUs"):
        train_on_ray(cfg, address=None, storage=str(tmp_path / "s"), name="big", max_failures=0)
    assert time.monotonic() - start < 30


def test_dead_address_is_one_line_and_fast(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    start = time.monotonic()
    proc = run_cli("train", str(config), "--address", "127.0.0.1:1", timeout=60)
    assert_user_error(proc, "nothing answers at --address 127.0.0.1:1")
    assert time.monotonic() - start < 30


def test_out_is_one_line_beside_storage_or_name(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    for flag in ("--storage", "--name"):
        proc = run_cli("train", str(config), "--out", str(tmp_path / "r"), flag, "x", timeout=60)
        assert_user_error(proc, "names the run folder", "--storage and --name")
    assert_user_error(run_cli("train", str(config), "--out", "s3://bucket", timeout=60), "--out s3://bucket")
    assert not (tmp_path / "r").exists()


def test_ctrl_c_keeps_the_checkpoint_and_the_same_command_resumes(tiny_data, tmp_path):
    """A Ray run goes to `--out` when given, and by default to runs/ray/NAME, apart from the
    `--local` runs of `train.out` (TensorBoard events of both kinds never mix): here the first
    run names runs/ray/experiment with --out, and the rerun finds it by default."""
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))  # train.out: the --local folder
    run_dir = tmp_path / "runs" / "ray" / "experiment"  # the config has no name: "experiment"
    command = ["train", str(config), "--set", "train.eval_interval=10"]
    command += ["--set", "model.n_layer=4", "--set", "model.d_model=128"]
    args = [
        sys.executable,
        "-m",
        "experiments",
        *command,
        "--out",
        str(run_dir),
        "--set",
        "train.max_steps=400",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 150
        while committed_step(run_dir) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert committed_step(run_dir) > 0, "no checkpoint was committed"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    kept = committed_step(run_dir)
    assert kept > 0 and (run_dir / "tensorboard").is_dir() and not (tmp_path / "run").exists()
    # The same command without --out, shortened on purpose (train.extend) so that the test ends soon.
    rerun = run_cli(
        *command, "--set", "train.max_steps=40", "--set", "train.extend=true", cwd=tmp_path, timeout=300
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resumed from checkpoint at step {kept}/" in rerun.stdout + rerun.stderr
    assert committed_step(run_dir) == 40


def test_sft_with_lora_runs_as_ddp_on_two_workers(ray_local, chat_data, pretrained, tmp_path, monkeypatch):
    from gptcore.checkpoint import CHECKPOINT_FILE, load_checkpoint

    monkeypatch.chdir(pretrained.parent)  # a relative init_from is resolved in the driver
    path = tmp_path / "sft.toml"
    path.write_text(tiny_config_text(chat_data, tmp_path / "run", stage="sft", init_from=pretrained.name))
    cfg = load_experiment(
        path, ["train.num_threads=1", "lora.rank=4", "resources.workers=2", "train.max_steps=8"]
    )
    storage = tmp_path / "storage"
    assert train_on_ray(cfg, address=None, storage=str(storage), name="sft", max_failures=0) == 0
    last = max((p for p in (storage / "sft").glob("checkpoint_*") if p.is_dir()), key=lambda p: p.name)
    state = load_checkpoint(last / CHECKPOINT_FILE)
    assert state["world_size"] == 2 and state["step"] == 8
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert state["lora_base"]["path"] == str(pretrained.resolve())
