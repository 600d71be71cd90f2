"""An autoscaling cluster on this machine: `cluster/local.sh up --autoscale 2` starts a head with no
CPU (production practice: the head runs no trial) whose Ray autoscaler, with Ray's fake
multi-node provider, adds 1-CPU worker nodes (min 0, max 2) and removes them after 5 s idle.

A sweep started on it with no worker node asks the autoscaler for nodes, runs every trial on the
nodes it adds, releases its request, and the idle nodes go away; a trial that no node type can
hold is refused in one line; `gptrun plan --address` shows the cluster's maximum.

The module shares one cluster for all its tests; `down` at the end checks that no process of it
(the added nodes included) is left."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO, assert_user_error, local_sh, write_sweep_config
from tests.test_cluster import (
    LocalCluster,
    assert_down_leaves_no_process,
    exp_trials,
    run_clean,
    sweep_args,
    tune_statuses,
    wait_for,
)

IDLE_S = 5
AWS_LIKE = {  # the shape of cluster/aws.yaml: a CPU head, GPU workers from 0
    "max_workers": 3,
    "head_node_type": "head",
    "available_node_types": {
        "head": {"resources": {"CPU": 4}, "max_workers": 0},
        "gpu": {"resources": {"CPU": 8, "GPU": 1}, "min_workers": 0, "max_workers": 4},
    },
}


def test_the_autoscalers_config_says_what_the_cluster_can_grow_to():
    from experiments.autoscale import Growth, NodeType, growth_from_config

    growth = growth_from_config(AWS_LIKE)
    assert growth == Growth((4.0, 0.0), (NodeType("gpu", 8.0, 1.0, 3),))  # capped by max_workers
    assert growth.maximum() == (28.0, 3.0)
    one_gpu = [{"CPU": 1, "GPU": 1}]
    assert growth.pack(one_gpu, 8) == (3, {"gpu": 3})
    assert growth.pack(one_gpu, 2) == (2, {"gpu": 2})  # capped by sweep.max_concurrent
    ddp = [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 0.01}]  # 2 workers + the trial's process
    assert growth.pack(ddp, 8) == (1, {"gpu": 2})  # 3 GPU nodes hold one 2-GPU trial
    unbounded = Growth((0.0, 0.0), (NodeType("cpu", 2.0, 0.0, -1),))
    assert unbounded.pack([{"CPU": 1}], 5) == (5, {"cpu": 3}) and unbounded.maximum() is None


def test_a_trial_no_node_type_holds_is_one_line():
    from experiments.autoscale import growth_from_config, plan_width
    from gptcore.errors import UserError

    with pytest.raises(UserError, match=r"1 x \(1 CPU \+ 2 GPU\), which no node type .* gpu: 8 CPU, 1 GPU"):
        plan_width(growth_from_config(AWS_LIKE), [{"CPU": 1, "GPU": 2}], 4, "one trial")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = tmp_path_factory.mktemp("autoscaling") / "state"
    proc = local_sh(
        "up", "--autoscale", "2", "--head-cpus", "0", "--cpus-per-node", "1",
        "--idle-timeout-s", str(IDLE_S), state=state,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "autoscaling to 2 worker node(s) of 1 CPU(s)" in proc.stdout, proc.stdout
    lc = LocalCluster(state)
    seen = list(lc.state["nodes"])
    try:
        yield lc
        assert_down_leaves_no_process(lc)  # after whichever test ran last, the autoscaler's nodes too
    finally:
        if (state / "state.json").exists():
            local_sh("down", "--grace", "10", state=state)
        lc.kill_everything(seen)


QUERY = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ray._raylet import GcsClient
from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
import local
state = json.load(open(sys.argv[2]))
raw = GcsClient(address=state["address"]).internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL, None)
nodes = local.gcs_nodes(state)
print(json.dumps({"nodes": nodes, "request": json.loads(raw) if raw else []}))
"""


def cluster_view(lc: LocalCluster) -> dict[str, Any]:
    """The GCS's nodes (alive and gone) and what the autoscaler is asked for now (the channel of
    `request_resources`), read in a child process: a GCS client caches the cluster's token."""
    proc = subprocess.run(
        [sys.executable, "-c", QUERY, str(REPO / "cluster"), str(lc.dir / "state.json")],
        env=lc.client_env(lc.dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def alive_workers(lc: LocalCluster) -> set[str]:
    return {n["node_id"] for n in cluster_view(lc)["nodes"] if n["alive"] and not n["head"]}


def test_plan_shows_what_the_cluster_can_grow_to(elastic, tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=4, max_steps=8)
    args = ["plan", str(config), "--address", elastic.address, "--tokens-per-sec", "1000"]
    proc, _ = run_clean(args, elastic.client_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4, 2 at a time" in proc.stdout, proc.stdout
    assert (
        "0 CPU / 0 GPU now, 2 CPUs and 0 GPUs at most (ray.worker.cpu: 1 CPU, 0 GPU, up to 2" in proc.stdout
    )


def test_a_trial_no_node_type_can_hold_is_refused_in_seconds(elastic, tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=2, max_steps=8)
    storage = tmp_path / "sweeps"
    proc, took = run_clean(
        sweep_args(config, "big", storage, elastic.address, cpus=8), elastic.client_env(tmp_path)
    )
    assert_user_error(proc, "1 x (8 CPU + 0 GPU), which no node type of the autoscaler can hold")
    assert "ray.worker.cpu: 1 CPU, 0 GPU (max 2)" in proc.stderr
    assert took < 60, took  # connecting and reading the autoscaler's config: no wait for nodes
    assert not storage.exists()


@pytest.mark.slow
def test_sweep_grows_the_cluster_from_nothing_and_lets_it_shrink(elastic, tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path / "cfg", n=4, max_steps=24)
    storage = tmp_path / "sweeps"
    wait_for(lambda: not alive_workers(elastic), 120, "a cluster with no worker node")
    head = next(n["node_id"] for n in cluster_view(elastic)["nodes"] if n["head"])
    proc, _ = run_clean(
        sweep_args(config, "grow", storage, elastic.address), elastic.client_env(tmp_path), 600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "waiting for 2 node(s) from the autoscaler (2 x ray.worker.cpu): 0/2 up" in proc.stdout
    assert "4 trials, 2 at a time" in proc.stdout

    trials = exp_trials(storage / "grow")
    statuses = tune_statuses(storage / "grow")
    assert len(trials) == 4 and set(statuses.values()) == {"TERMINATED"}, statuses
    nodes = {rows[-1]["node_id"] for rows in trials.values()}
    view = cluster_view(elastic)
    known = {n["node_id"] for n in view["nodes"]}  # alive or gone: the GCS remembers them
    assert head not in nodes and nodes <= known, (nodes, known)

    from experiments.table import short_ids

    shown = short_ids(nodes)  # the table's node column tells the added nodes apart
    assert len(set(shown.values())) == len(nodes), shown
    table = proc.stdout[proc.stdout.rindex("val_loss") :]
    assert all(short in table for short in shown.values()), (shown, table)
    assert view["request"] == []  # released: nothing keeps the nodes
    wait_for(lambda: not alive_workers(elastic), 120, "the idle nodes to go away")


UNANSWERED = """
import json, os, signal, sys, time
import ray
from ray.autoscaler.sdk import request_resources
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_tasks
from experiments.cluster import verify_shared_storage
ray.init(address=sys.argv[1], logging_level="warning")
request_resources(num_cpus=1)  # a worker node beside the head: a check of 2 nodes
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    time.sleep(0.5)
head = "node:__internal_head__"
worker = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and head not in n["Resources"])
on_worker = NodeAffinitySchedulingStrategy(worker, soft=False)

@ray.remote(num_cpus=0)
def parent_pid():
    return os.getppid()

raylet = ray.get(parent_pid.options(scheduling_strategy=on_worker).remote())
assert b"raylet" in open(f"/proc/{raylet}/cmdline", "rb").read(), raylet  # a task's parent
os.kill(raylet, signal.SIGSTOP)  # the node cannot answer; seconds: well within the GCS's health checks
try:
    verify_shared_storage(sys.argv[2], timeout=3)
finally:
    os.kill(raylet, signal.SIGCONT)
request_resources(bundles=[])
deadline = time.monotonic() + 60
while True:  # until every reader has ended: run (FINISHED) or cancelled (FAILED)
    tasks = list_tasks(sys.argv[1], filters=[("func_or_class_name", "=", "_read_marker")], detail=True)
    ended = [t for t in tasks if t.state in ("FINISHED", "FAILED")]
    if (tasks and len(ended) == len(tasks)) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([[t.state, t.error_type] for t in tasks]))
"""


@pytest.mark.slow
def test_shared_storage_check_cancels_the_tasks_nodes_did_not_answer(elastic, tmp_path):
    """A node whose raylet is stopped cannot answer the check in time: its marker reader, still
    queued when the check gives up, is cancelled, not left to run once the node is back."""
    args = [sys.executable, "-c", UNANSWERED, elastic.address, str(tmp_path)]
    env = {**elastic.client_env(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    unanswered = re.search(
        r"warning: (\d+) node\(s\) did not answer the shared-storage check within 3s", proc.stdout
    )
    assert unanswered, proc.stdout[-2000:]
    tasks = json.loads(proc.stdout.strip().splitlines()[-1])
    cancelled = [t for t in tasks if t == ["FAILED", "TASK_CANCELLED"]]
    assert len(tasks) >= 2 and len(cancelled) == int(unanswered[1]) >= 1, tasks  # none ran later
    assert not list(tmp_path.glob(".gptrun-shared-check-*"))
