"""Joining a Ray cluster: `--address` that fails fast with one line, storage that is not created
before the cluster answers, and (slow) a real 2-node cluster started by `cluster/local.sh` with
token auth: refusal without the token, a sweep over both nodes, a lost worker node, a lost
driver resumed, and `down` leaving no process.

The slow module shares one cluster (head + 1 worker node, 2 CPUs each) for all its tests."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from experiments import cluster
from gptcore.errors import UserError
from tests.conftest import (
    NO_AUTH,
    REPO,
    assert_user_error,
    load_local_module,
    local_sh,
    tiny_config_text,
    write_sweep_config,
)

WAIT_S = 20.0  # GPTRUN_RESOURCE_WAIT_S given to the CLI in these tests (the default)
# What a refused address may take: the wait, plus the CLI's own start-up (importing torch and Ray
# took up to 21 s on 2 cores busy with other tests). Ray's own retries of an address that is not
# a head go on far longer; that our probe answered is shown by its one line.
BOUND_S = WAIT_S + 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def web_server() -> Iterator[int]:
    """A plain HTTP server on a free loopback port: something listens, but not Ray."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a client that has no Ray token at all (no env, no ~/.ray)."""
    env = {k: v for k, v in os.environ.items() if k not in NO_AUTH}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "GPTRUN_RESOURCE_WAIT_S": f"{WAIT_S:g}", **extra}


def run_clean(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    """`run_cli` with exactly `env` (run_cli merges os.environ in, which may hold a token)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", *args],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


# ------------------------------------------------------------------ fast: no cluster needed


def test_train_against_a_web_server_is_one_line_within_the_wait(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    storage = tmp_path / "deep" / "storage"
    with web_server() as port:
        proc, took = run_clean(
            ["train", str(config), "--address", f"127.0.0.1:{port}", "--storage", str(storage)],
            clean_env(tmp_path),
        )
    assert_user_error(proc, f"127.0.0.1:{port}", "not a Ray head")
    assert took < BOUND_S, took
    assert not storage.exists() and not storage.parent.exists()


def test_sweep_against_nothing_is_one_line_and_creates_nothing(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    storage = tmp_path / "sweeps"
    port = free_port()
    proc, took = run_clean(
        ["sweep", str(config), "--address", f"127.0.0.1:{port}", "--storage", str(storage)],
        clean_env(tmp_path),
    )
    assert_user_error(proc, f"nothing answers at --address 127.0.0.1:{port}")
    assert took < BOUND_S, took
    assert not storage.exists()


def test_sweep_against_a_web_server_is_one_line(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    storage = tmp_path / "sweeps"
    with web_server() as port:
        proc, took = run_clean(
            ["sweep", str(config), "--address", f"127.0.0.1:{port}", "--storage", str(storage)],
            clean_env(tmp_path),
        )
    assert_user_error(proc, "not a Ray head")
    assert took < BOUND_S, took
    assert not storage.exists()


@pytest.mark.parametrize("prefix", ["", "ray://"])
def test_probe_of_a_web_server_is_bounded(prefix):
    """What resume and confirm call (`ray_session(address)`), for GCS and Ray Client addresses:
    `ray.init` alone keeps retrying a non-Ray port; the probe answers in about a second."""
    with web_server() as port:
        start = time.monotonic()
        with (
            pytest.raises(UserError, match="not a Ray head"),
            cluster.ray_session(f"{prefix}127.0.0.1:{port}"),
        ):
            pytest.fail("the session must not start")
        assert time.monotonic() - start < 10


def test_probe_of_a_raylet_like_grpc_service_says_it_is_not_the_head():
    """A gRPC server that lacks the GCS's method (here: a bare grpcio server) is named as such."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(UserError, match="gRPC service that is not the Ray head"):
            cluster.check_cluster(f"127.0.0.1:{port}", timeout=5)
    finally:
        server.stop(None)


@pytest.mark.parametrize("address", ["localhost", "host:port", "ray://nohost", ":6379"])
def test_malformed_addresses_are_one_line(address):
    with pytest.raises(UserError, match="is not 'auto', 'host:port' or 'ray://host:port'"):
        cluster.check_cluster(address)


def test_ray_address_env_is_the_default_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster.resolve_address(None) == "10.0.0.1:6379"
    assert cluster.resolve_address("127.0.0.1:7000") == "127.0.0.1:7000"
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.resolve_address(None) is None


@pytest.mark.parametrize("command", ["sweep", "train"])
def test_ray_address_is_the_cluster_checked_not_this_machine(tiny_data, tmp_path, command):
    """With $RAY_ADDRESS set and no --address, a GPU request from a CPU-only client is for the
    cluster to judge: the client probes the address (here: nothing listens) instead of refusing
    because this machine has no GPU."""
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    port = free_port()
    args = [command, str(config), "--storage", str(tmp_path / "out"), "--set", "resources.gpus_per_worker=1"]
    proc, took = run_clean(args, clean_env(tmp_path, RAY_ADDRESS=f"127.0.0.1:{port}"))
    assert_user_error(proc, f"nothing answers at --address 127.0.0.1:{port}")
    assert took < BOUND_S, took
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variable", ["GPTRUN_RESOURCE_WAIT_S", "GPTRUN_AUTOSCALE_WAIT_S"])
def test_a_wait_that_is_not_a_number_is_one_line(tiny_data, tmp_path, variable):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    env = clean_env(tmp_path, **{variable: "20s"})
    proc, _ = run_clean(["train", str(config), "--address", f"127.0.0.1:{free_port()}"], env)
    assert_user_error(proc, f"{variable}='20s' is not a number of seconds")


def test_check_storage_creates_nothing_and_create_storage_does(tmp_path):
    target = tmp_path / "a" / "b"
    resolved = cluster.check_storage(str(target), "unused")
    assert resolved == str(target) and not (tmp_path / "a").exists()
    cluster.create_storage(resolved)
    assert target.is_dir()
    assert cluster.check_storage(None, str(target)) == str(target)
    uri = f"file://{tmp_path}/uri/x"
    assert cluster.check_storage(uri, "x") == uri and not (tmp_path / "uri").exists()


def test_check_storage_rejects_files_on_the_way(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="is a file; give a folder or a URI"):
        cluster.check_storage(str(blocker), "x")
    with pytest.raises(UserError, match=f"{blocker} is a file"):
        cluster.check_storage(str(blocker / "sub" / "dir"), "x")
    with pytest.raises(UserError, match="--storage nope://x"):
        cluster.check_storage("nope://x", "x")


# ------------------------------------------------------------------ slow: a real 2-node cluster


class LocalCluster:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.local = load_local_module()

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.dir / "state.json").read_text())

    @property
    def address(self) -> str:
        return self.state["address"]

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.state["nodes"] if n["name"] == name)

    def client_env(self, tmp_path: Path, **extra: str) -> dict[str, str]:
        return clean_env(
            tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.state["token_path"], **extra
        )

    def pids(self, nodes: list[dict[str, Any]] | None = None) -> list[int]:
        return [p.pid for n in (nodes or self.state["nodes"]) for p in self.local.session(n)]

    def kill_everything(self, nodes: list[dict[str, Any]]) -> None:
        """Teardown of last resort, by recorded session only."""
        for node in nodes:
            self.local.stop_node(node, 5.0, signal.SIGKILL)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = tmp_path_factory.mktemp("cluster") / "state"
    proc = local_sh("up", "--nodes", "1", "--cpus-per-node", "2", state=state)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lc = LocalCluster(state)
    assert f"export RAY_ADDRESS={lc.address} RAY_AUTH_MODE=token" in proc.stdout
    assert f"--address {lc.address}" in proc.stdout
    seen: list[dict[str, Any]] = list(lc.state["nodes"])
    try:
        yield lc
        seen += lc.state["nodes"]
        assert_down_leaves_no_process(lc)  # after whichever test ran last
    finally:
        if (state / "state.json").exists():
            seen += lc.state["nodes"]
            local_sh("down", "--grace", "10", state=state)
        lc.kill_everything(seen)


def exp_trials(exp_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every report of every trial, from the trials' result.json files."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(exp_dir.glob("*/result.json")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            out[rows[0]["trial_id"]] = rows
    return out


def tune_statuses(exp_dir: Path) -> dict[str, str]:
    from ray.tune import ExperimentAnalysis

    return {t.trial_id: t.status for t in ExperimentAnalysis(str(exp_dir)).trials}


def sweep_args(config: Path, name: str, storage: Path, address: str, *sets: str, cpus: int = 1) -> list[str]:
    # `cpus`-CPU trials, a checkpoint every 8 steps (the Tune reports carry them).
    args = ["sweep", str(config), "--name", name, "--storage", str(storage), "--address", address]
    for item in (
        f"resources.cpus_per_worker={cpus}",
        "train.eval_interval=8",
        "train.checkpoint_interval=8",
        *sets,
    ):
        args += ["--set", item]
    return args


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"sweep exited ({proc.returncode}) before {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def start_sweep(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "experiments", *args],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=handle,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("token", ["none", "wrong"])
def test_client_without_the_token_is_refused(two_nodes, tiny_data, tmp_path, token):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    env = (
        clean_env(tmp_path)
        if token == "none"
        else clean_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    )
    storage = tmp_path / "storage"
    proc, took = run_clean(
        ["train", str(config), "--address", two_nodes.address, "--storage", str(storage)], env
    )
    assert_user_error(proc, f"the Ray cluster at {two_nodes.address} refused this client")
    assert took < BOUND_S and not storage.exists()


@pytest.mark.slow
def test_status_lists_both_nodes_alive(two_nodes):
    proc = local_sh("status", state=two_nodes.dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "alive: 2 node(s), 4 CPUs" in proc.stdout
    for node in two_nodes.state["nodes"]:
        assert node["node_id"] in proc.stdout


@pytest.mark.slow
def test_sweep_runs_trials_on_both_nodes(two_nodes, tiny_data, tmp_path):
    """Trials of 2 CPUs on 2-CPU nodes: the two that run at once cannot share a node."""
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=4, max_steps=48)
    storage = tmp_path / "sweeps"
    proc, _ = run_clean(
        sweep_args(config, "both", storage, two_nodes.address, cpus=2),
        two_nodes.client_env(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 trials, 2 at a time" in proc.stdout, proc.stdout[:2000]
    trials = exp_trials(storage / "both")
    assert len(trials) == 4
    nodes = {rows[-1].get("node_id") for rows in trials.values()}
    ids = {n["node_id"] for n in two_nodes.state["nodes"]}
    assert nodes == ids, (nodes, ids)


@pytest.mark.slow
def test_lost_worker_node_trials_resume_from_their_checkpoints(two_nodes, tiny_data, tmp_path):
    steps = 400
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=4, max_steps=steps)
    storage = tmp_path / "sweeps"
    exp = storage / "lost"
    worker = two_nodes.node("worker1")["node_id"]
    no_cut = f"sweep.grace_tokens={steps * 4 * 32}"  # ASHA's first rung at the end: all run long

    def checkpointed_on_worker() -> bool:
        return (
            any(
                r.get("node_id") == worker and r.get("step", 0) >= 16
                for rows in exp_trials(exp).values()
                for r in rows
            )
            if exp.exists()
            else False
        )

    proc = start_sweep(
        sweep_args(config, "lost", storage, two_nodes.address, no_cut),
        two_nodes.client_env(tmp_path),
        tmp_path / "sweep.log",
    )
    try:
        wait_for(checkpointed_on_worker, 150, "a checkpointed report from worker1", proc)
        killed = local_sh("kill-node", "worker1", state=two_nodes.dir)
        assert killed.returncode == 0, killed.stderr
        # The trials the dead node was running: their last report came from it, before the end.
        on_worker = {
            tid
            for tid, rows in exp_trials(exp).items()
            if rows[-1].get("node_id") == worker and rows[-1].get("step", 0) < steps
        }
        assert proc.wait(timeout=240) == 0, (tmp_path / "sweep.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        restarted = local_sh("start-node", "worker1", state=two_nodes.dir)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    trials = exp_trials(exp)
    statuses = tune_statuses(exp)
    assert len(trials) == 4 and set(statuses) == set(trials)  # none lost, none duplicated
    assert set(statuses.values()) == {"TERMINATED"}, statuses
    assert on_worker, "worker1 had finished its trials before it was killed: nothing tested"
    for tid in on_worker:
        rows = [r for r in trials[tid] if "step" in r]
        lost = max(i for i, r in enumerate(rows) if r["node_id"] == worker)
        before, after = rows[: lost + 1], rows[lost + 1 :]
        assert after and after[-1]["step"] == steps, (tid, rows[-1])
        assert after[-1]["node_id"] != worker  # finished elsewhere (the worker node was dead)
        # Continued from its last committed checkpoint: not step 0, and only the reports after
        # that checkpoint (at most a few intervals) are trained and reported again.
        resumed_from = after[0]["resumed_from"]
        assert 0 < resumed_from <= before[-1]["step"], (tid, before[-1], after[0])
        assert resumed_from >= before[-1]["step"] - 3 * 8, (tid, before[-1], after[0])
        for part in (before, after):
            steps_seen = [r["step"] for r in part]
            assert steps_seen == sorted(set(steps_seen)), (tid, steps_seen)


@pytest.mark.slow
def test_killed_driver_is_resumed_on_the_cluster(two_nodes, tiny_data, tmp_path):
    steps = 200
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=3, max_steps=steps)
    storage = tmp_path / "sweeps"
    exp = storage / "driver"
    env = two_nodes.client_env(tmp_path)
    proc = start_sweep(
        sweep_args(config, "driver", storage, two_nodes.address, f"sweep.grace_tokens={steps * 4 * 32}"),
        env,
        tmp_path / "sweep.log",
    )
    try:
        wait_for(
            lambda: (
                exp.exists()
                and any(r.get("step", 0) >= 16 for rows in exp_trials(exp).values() for r in rows)
            ),
            150,
            "a checkpointed report",
            proc,
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver (and only it: it is its own session)
        proc.wait()
    resumed, _ = run_clean(["resume", str(exp), "--address", two_nodes.address], env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    statuses = tune_statuses(exp)
    assert len(statuses) == 3 and set(statuses.values()) == {"TERMINATED"}, statuses
    trials = exp_trials(exp)
    assert all(rows[-1]["step"] == steps for rows in trials.values()), {
        t: rows[-1].get("step") for t, rows in trials.items()
    }


@pytest.mark.slow
def test_storage_a_node_does_not_see_is_refused_naming_the_node(two_nodes, tiny_data, tmp_path, monkeypatch):
    """A third node sees its own empty tmpfs over the --storage folder (its raylet and workers run
    in a private mount namespace), as a node that has a local disk where the others mount NFS
    would: `gptrun train` refuses in one line that names the node, before anything trains."""
    storage = tmp_path / "storage"
    storage.mkdir()
    with node_without(two_nodes, monkeypatch, storage, "blind"):
        config = tmp_path / "exp.toml"
        config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
        args = ["train", str(config), "--address", two_nodes.address, "--storage", str(storage)]
        proc, _ = run_clean(args, two_nodes.client_env(tmp_path))
        assert_user_error(proc, "is not shared: node(s) ")
        named = proc.stderr.split("node(s)")[1].split("do not see")[0]
        assert named.count("(") == 1, named  # one node, and not one of the two that share the disk
        assert not any(n["node_id"][:8] in named for n in two_nodes.state["nodes"]), named
        assert list(storage.iterdir()) == []  # no run folder, and the check's marker is gone


@contextlib.contextmanager
def third_node(two_nodes: LocalCluster, monkeypatch: Any, name: str, wrap: list[str]) -> Iterator[None]:
    """A third node whose `ray start` runs under the command `wrap` (which execs what follows
    it), started from a copy of the state (`down` never hears of it) and stopped on the way out."""
    local = two_nodes.local
    monkeypatch.setattr(local, "RAY", [*wrap, *local.RAY])
    node = local.start_node(two_nodes.dir, two_nodes.state, name, 1, 0)
    try:
        wait_for(lambda: "alive: 3 node(s)" in local_sh("status", state=two_nodes.dir).stdout, 60, "3 nodes")
        yield
    finally:
        assert local.stop_node(node, grace=10) == []


def node_without(two_nodes: LocalCluster, monkeypatch: Any, folder: Path, name: str) -> Any:
    """A third node whose raylet and workers see an empty tmpfs over `folder` (a private mount
    namespace), as a node without a mount the others have would."""
    hide = 'mount -t tmpfs gptrun-hidden "$0" && exec "$@"'  # $0: the folder, $@: ray start ...
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, str(folder)]
    return third_node(two_nodes, monkeypatch, name, wrap)


# A driver that joins the cluster as gptrun does and asks each node for the Ray Train settings.
SETTINGS_CHILD = """
import json, os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from experiments.cluster import ray_session

NAMES = ("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
         "RAY_TRAIN_ENABLE_PRINT_PATCH")

@ray.remote(num_cpus=0)
def settings():
    return {name: os.environ.get(name) for name in NAMES}

os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"  # as `gptrun` (experiments.cli.main) sets it
with ray_session(sys.argv[1]):
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    strategy = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)
    print(json.dumps(ray.get([settings.options(scheduling_strategy=strategy(n)).remote() for n in nodes])))
"""


# What Ray's job supervisor hands the entrypoint of `ray job submit --runtime-env-json ...` (a
# KubeRay RayJob) whose runtime_env sets one of the settings: the JobConfig, and the variable.
SUBMITTED = {
    "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
        {"runtime_env": {"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "1800"}}, "metadata": {}}
    ),
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "1800",
}


@pytest.mark.slow
@pytest.mark.parametrize("job, timeout", [({}, "900"), (SUBMITTED, "1800")], ids=["driver", "submitted-job"])
def test_the_drivers_ray_train_settings_reach_every_node(two_nodes, tmp_path, job, timeout):
    """A DDP trial's TorchTrainer is built in its Tune trial actor, which has its raylet's
    environment, and Ray Train passes on what that process's environment holds: the settings
    the driver puts in os.environ must reach the job's processes on every node (runtime_env).
    Under `ray job submit` the job's runtime_env carries its own, which `ray.init` must not be
    given again (Ray refuses a second value for a variable, even an equal one)."""
    proc = subprocess.run(
        [sys.executable, "-c", SETTINGS_CHILD, two_nodes.address],
        cwd=REPO,
        env={**two_nodes.client_env(tmp_path), "PYTHONPATH": str(REPO), **job},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_node = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(per_node) == 2
    for settings in per_node:
        assert settings == {
            "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": timeout,
            "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        }


@pytest.mark.slow
def test_a_node_without_the_data_is_refused_naming_the_node(two_nodes, tiny_data, tmp_path, monkeypatch):
    """A third node sees an empty tmpfs over data.dir (as a node without the data mount would):
    `gptrun train` and `gptrun sweep` refuse in one line naming it, before any trial starts;
    so do `gptrun resume` and `gptrun confirm` of a sweep that ran before the node joined (the
    cluster a sweep goes on with need not be the one it began on)."""
    env = two_nodes.client_env(tmp_path)
    done = tmp_path / "done"
    sweep_config = write_sweep_config(tiny_data, tmp_path / "sweep", n=1, max_steps=8)
    proc, _ = run_clean(sweep_args(sweep_config, "done", done, two_nodes.address), env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoints = sorted(done.rglob("checkpoint*"))
    with node_without(two_nodes, monkeypatch, tiny_data, "nodata"):
        config = tmp_path / "exp.toml"
        config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
        storage = tmp_path / "storage"
        train = ["train", str(config), "--address", two_nodes.address, "--storage", str(storage)]
        sweep = sweep_args(sweep_config, "nodata", storage, two_nodes.address)
        on_cluster = ["--address", two_nodes.address]
        resume = ["resume", str(done / "done"), *on_cluster]
        confirm = ["confirm", str(done / "done"), "--top", "1", "--seeds", "2", *on_cluster]
        for args in (train, sweep, resume, confirm):
            proc, _ = run_clean(args, env)
            assert_user_error(proc, f"data.dir {tiny_data} is not usable on node(s) ", "every node that runs")
            one_node = r"on node\(s\) [\d.]+ \([0-9a-f]{8}\) \(.*meta\.json not found"  # the one without it
            assert re.search(one_node, proc.stderr), proc.stderr
            assert not any(n["node_id"][:8] in proc.stderr for n in two_nodes.state["nodes"]), proc.stderr
        assert not list(storage.rglob("checkpoint*"))  # no trial ran
        assert sorted(done.rglob("checkpoint*")) == checkpoints


def test_a_node_with_another_torch_is_refused_naming_both_versions(
    two_nodes, tiny_data, tmp_path, monkeypatch
):
    """A third node whose Python finds another torch first (an older release's metadata ahead on
    its PYTHONPATH): `gptrun sweep` refuses in one line naming the node and both versions, before
    any trial starts. (torch, not gptrun: Ray puts the driver's working folder, this checkout
    with gptrun's own metadata, first on every worker's path on this machine.)"""
    older = tmp_path / "older"
    metadata = older / "torch-2.0.1.dist-info" / "METADATA"
    metadata.parent.mkdir(parents=True)
    metadata.write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.0.1+cu118\n")
    path = f"{older}:{os.environ.get('PYTHONPATH', '')}"
    with third_node(two_nodes, monkeypatch, "older", ["env", f"PYTHONPATH={path}"]):
        storage = tmp_path / "storage"
        sweep_config = write_sweep_config(tiny_data, tmp_path / "sweep", n=2, max_steps=8)
        args = sweep_args(sweep_config, "older", storage, two_nodes.address)
        proc, _ = run_clean(args, two_nodes.client_env(tmp_path))
        assert_user_error(proc, "runs torch 2.0.1, this driver gptrun ", "install the same gptrun")
        assert not any(n["node_id"][:8] in proc.stderr for n in two_nodes.state["nodes"]), proc.stderr
        assert not list(storage.rglob("checkpoint*"))  # no trial ran


def assert_down_leaves_no_process(lc: LocalCluster) -> None:
    """`down` stops every process of the cluster's nodes' sessions (on an autoscaling cluster,
    the nodes the autoscaler added too: they live in the head's session). Checked as the
    cluster's fixture ends: a failure is an error in the teardown of the module's last test."""
    nodes = lc.state["nodes"]
    assert lc.pids(nodes)
    proc = local_sh("down", state=lc.dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no process left" in proc.stdout
    assert lc.pids(nodes) == []
    for node in nodes:  # the recorded leaders are gone (or zombies: exited), not just their sessions
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(node["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not Path(lc.dir / "state.json").exists()
    assert local_sh("status", state=lc.dir).returncode == 1
