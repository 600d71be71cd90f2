"""A multi-node Ray cluster on one machine: a head plus N worker nodes, token auth on.

Run it through `cluster/local.sh` (same arguments; its header lists the commands). Each node is its
own `ray start --block` in its own session (setsid), like a separate machine that shares the loopback
interface and the disk. `down` signals exactly those sessions (SIGTERM, then SIGKILL after a grace
period) and checks that none of their processes is left: it never touches another Ray on the machine.
`up --autoscale MAX`: the head runs Ray's autoscaler with its fake multi-node provider (as Ray's own
tests do), which adds up to MAX worker nodes when work waits, in the head's session, and removes
idle ones. State (--dir, $GPTRUN_CLUSTER_DIR or ./.cluster): `state.json`, `token` (mode 0600, for
every node and client), `env.sh` (the client's exports), `logs/`. Linux only; needs psutil and Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from experiments.cli import OneLineParser  # a usage error is one line, as in `gptrun`
from experiments.private_ray import gcs_node_infos  # private Ray names only behind that fence
from gptcore.errors import UserError  # bad input: one line, exit 2

LOOPBACK = "127.0.0.1"
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this Python
NODE_PORTS = (  # each node's `ray start --NAME-port`: Ray's defaults (the agent's 52365) would collide
    "node-manager object-manager dashboard-agent-listen dashboard-agent-grpc runtime-env-agent metrics-export"
).split()


class ClusterError(Exception):
    """A failure at run time: one line for the user, exit status 1."""


def checked(convert: Any, ok: Any, what: str) -> Any:
    """An option's type that refuses a bad value as it is parsed, not once the head runs (exit 1, a
    log to read): Ray takes port 99999 modulo 65536, and float() takes 'nan', which passes `<= 0`."""

    def parse(text: str) -> Any:
        with contextlib.suppress(ValueError):
            if ok(value := convert(text)):
                return value
        raise argparse.ArgumentTypeError(f"{text!r} {what}")

    return parse


def whole(low: int) -> Any:
    return checked(int, lambda v: v >= low, f"must be a whole number >= {low}")


PORT = checked(int, lambda v: 1 <= v <= 65535, "is not a port (1-65535)")
SECONDS = checked(float, lambda v: 0 < v < float("inf"), "must be a number of seconds > 0")


def load_state(root: Path, required: bool = True) -> dict[str, Any] | None:
    if required and not (root / "state.json").exists():
        raise ClusterError(f"no cluster state in {root}; `cluster/local.sh up` first (or pass --dir)")
    return json.loads((root / "state.json").read_text()) if (root / "state.json").exists() else None


def save_state(root: Path, state: dict[str, Any]) -> None:
    (root / "state.tmp").write_text(json.dumps(state, indent=1))
    os.replace(root / "state.tmp", root / "state.json")  # a reader never sees half a file


def session(node: dict[str, Any]) -> list[psutil.Process]:
    """The live processes of a node: those in the session its `ray start` created, which they keep
    when Ray puts them in groups of their own or the leader dies. A zombie has exited (a container's
    PID 1 may never reap orphans); a leader's pid that is another program's now is not ours."""
    procs = []
    for proc in (p for p in psutil.process_iter(["status", "cmdline"]) if p.info["status"] != "zombie"):
        if proc.pid == node["pid"] and node["temp_dir"] not in (proc.info["cmdline"] or ()):
            return []
        with contextlib.suppress(ProcessLookupError):  # gone since the listing
            if os.getsid(proc.pid) == node["pid"]:
                procs.append(proc)
    return procs


def stop_node(node: dict[str, Any], grace: float, first: int = signal.SIGTERM) -> list[int]:
    """SIGTERM the node's `ray start`, which stops the rest (all, if it is gone or `first` is SIGKILL),
    then SIGKILL what is left after `grace` s; the pids alive then. (psutil.wait_procs waits on zombies.)"""
    procs = session(node)
    for sig, wait in ((first, grace), (signal.SIGKILL, 5.0)):
        leader = [p for p in procs if p.pid == node["pid"] and sig == signal.SIGTERM]
        for proc in leader or procs:
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil refuses a pid reused since, too
                proc.send_signal(sig)
        deadline = time.monotonic() + wait
        while (procs := session(node)) and time.monotonic() < deadline:
            time.sleep(0.2)
    return [p.pid for p in procs]


def tcp_ports(status: str | None = None) -> set[int]:
    """The local ports of this machine's TCP sockets (every user's), or of those in `status`."""
    return {c.laddr.port for c in psutil.net_connections("tcp") if status in (None, c.status)}


def free_ports(n: int, taken: set[int]) -> list[int]:
    """`n` distinct ports of the kernel's ephemeral range that no socket uses now, none of `taken`."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return random.sample(sorted(set(range(low, high + 1)) - taken - tcp_ports()), n)


def write_autoscaling_config(root: Path, state: dict[str, Any], args: argparse.Namespace, cpus: int) -> None:
    """The autoscaler's config for Ray's fake multi-node provider, a head of `cpus` CPUs and one
    worker type, as Ray reads it: with no defaults filled in, hence the empty lists. The provider
    must be told the GCS address, else its nodes dial 6379."""
    provider = {"type": "fake_multinode", "gcs_address": state["address"], "use_node_id_as_ip": True}
    provider |= {"disable_node_updaters": True, "disable_launch_config_check": True}
    head = {"resources": {"CPU": cpus, "GPU": 0}, "node_config": {}, "max_workers": 0}
    worker = {"resources": {"CPU": args.cpus_per_node, "GPU": args.gpus_per_node}, "node_config": {}}
    worker |= {"min_workers": 0, "max_workers": args.autoscale}
    types = {"ray.head.default": head, "ray.worker.cpu": worker}
    config = {"cluster_name": f"gptrun-local-{state['port']}", "max_workers": args.autoscale}
    config |= {"provider": provider, "head_node_type": "ray.head.default", "available_node_types": types}
    config |= {"idle_timeout_minutes": args.idle_timeout_s / 60, "auth": {}, "docker": {}, "file_mounts": {}}
    empty = "setup_commands head_setup_commands worker_setup_commands head_start_ray_commands rsync_exclude"
    empty += " worker_start_ray_commands initialization_commands cluster_synced_files rsync_filter"
    config |= {key: [] for key in empty.split()}
    (root / "autoscaler.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML


def start_node(root: Path, state: dict[str, Any], name: str, cpus: int, gpus: int) -> dict:
    """Launch `ray start --block` for one node in a new session; its record (not yet known to be
    up: see `start_nodes`). The head also serves the dashboard and Ray Client, on ports of its own."""
    keys = NODE_PORTS + ["dashboard", "ray-client-server"] * (name == "head")
    taken = {state["port"], *(p for n in state["nodes"] for p in n["ports"].values())}
    ports = dict(zip(keys, free_ports(len(keys), taken), strict=True))
    temp_dir = str(Path(state["temp_root"]) / name)
    # Worker ports 0/0: each worker binds one the OS picks, so no node (or other Ray here) needs a range.
    memory = state["object_store_mb"] << 20
    flags = f"--block --disable-usage-stats --node-ip-address={LOOPBACK} --object-store-memory={memory} "
    flags += f"--num-cpus={cpus} --num-gpus={gpus} --min-worker-port=0 --max-worker-port=0 "
    flags += " ".join(f"--{key}-port={port}" for key, port in ports.items())
    head = f" --head --port={state['port']} --include-dashboard=true --dashboard-host={LOOPBACK}"
    flags += head if name == "head" else f" --address={state['address']}"
    # --temp-dir as two words, the folder alone: `session` knows the node's `ray start` by it.
    args = [*RAY, "start", *flags.split(), "--temp-dir", temp_dir]
    stray = ("RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")  # a token would override the file
    env = {k: v for k, v in os.environ.items() if k not in stray} | {"RAY_USAGE_STATS_ENABLED": "0"}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": state["token_path"]}
    if name == "head" and state["autoscale"]:  # the fake provider's switch; an update every second
        args.append(f"--autoscaling-config={root / 'autoscaler.yaml'}")
        env |= {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    log = root / "logs" / f"{name}.log"
    with open(log, "ab") as out:
        kwargs = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": out, "env": env, "cwd": root}
        pid = subprocess.Popen(args, start_new_session=True, **kwargs).pid
    node = {"name": name, "head": name == "head", "pid": pid, "cpus": cpus, "gpus": gpus, "ports": ports}
    return node | {"temp_dir": temp_dir, "log": str(log), "log_offset": log.stat().st_size}


def gcs_nodes(state: dict[str, Any], timeout: float = 10.0) -> list[dict[str, Any]]:
    """The nodes the head's GCS knows, alive and dead, as dicts."""
    if state["port"] not in tcp_ports(psutil.CONN_LISTEN):
        raise ClusterError(f"nothing listens at {state['address']}: the head is down")
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_path"])
    os.environ.pop("RAY_AUTH_TOKEN", None)
    return [
        {"node_id": n.node_id.hex(), "alive": n.state == 0, "port": n.node_manager_port}
        | {"head": n.is_head_node, "resources": dict(n.resources_total)}
        for n in gcs_node_infos(state["address"], timeout)
    ]


def start_nodes(root: Path, state: dict[str, Any], specs: list[tuple[str, int, int]], timeout: float) -> None:
    """Start nodes (name, CPUs, GPUs) in `state`, saved before the wait (`down` finds whatever started);
    wait until each `ray start` says the runtime started and the GCS lists the node alive (known by its
    raylet's port), and record its id. One line if a `ray start` exits first, or the time runs out."""
    for name, cpus, gpus in specs:
        node = start_node(root, state, name, cpus, gpus)
        state["nodes"] = [n for n in state["nodes"] if n["name"] != name] + [node]
        save_state(root, state)
    nodes, deadline = state["nodes"][-len(specs) :], time.monotonic() + timeout
    while True:
        logs = [Path(n["log"]).read_bytes()[n["log_offset"] :].decode(errors="replace") for n in nodes]
        for node, text in zip(nodes, logs, strict=True):
            if "Ray runtime started." not in text and node["pid"] not in {p.pid for p in session(node)}:
                tail = " | ".join(line.strip() for line in text.splitlines()[-4:] if line.strip())
                raise ClusterError(f"node {node['name']} failed to start ({tail}); log: {node['log']}")
        if all("Ray runtime started." in text for text in logs):  # so the GCS is up: registered?
            alive = {g["port"]: g["node_id"] for g in gcs_nodes(state) if g["alive"]}
            if all(n["ports"]["node-manager"] in alive for n in nodes):
                break
        if time.monotonic() > deadline:
            raise ClusterError(f"not all of {len(nodes)} node(s) up within {timeout:g}s; see {root / 'logs'}")
        time.sleep(0.3)
    for node in nodes:
        node["node_id"] = alive[node["ports"]["node-manager"]]
    save_state(root, state)


def cmd_up(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root, required=False)
    if state and any(session(n) for n in state["nodes"]):
        raise ClusterError(f"a cluster from {root} runs; `cluster/local.sh down` first, or use another --dir")
    if args.autoscale and args.nodes:
        raise UserError("--autoscale MAX adds the worker nodes itself; leave --nodes out")
    if args.port in tcp_ports(psutil.CONN_LISTEN):
        raise UserError(f"port {args.port} is in use; pick another --port or leave it out")
    (root / "logs").mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    token = root / "token"
    token.unlink(missing_ok=True)
    token.touch(mode=0o600, exist_ok=False)  # before the secret is in it: never readable by others
    token.write_text(secrets.token_hex(32))
    port = args.port or free_ports(1, set())[0]
    address, token_path = f"{LOOPBACK}:{port}", shlex.quote(str(token))
    state = {"address": address, "port": port, "token_path": str(token), "nodes": []}
    state["exports"] = f"export RAY_ADDRESS={address} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}"
    temp_root = tempfile.mkdtemp(prefix="gptrun-ray-")  # short: Unix socket paths <= 107 bytes
    state |= {"temp_root": temp_root, "object_store_mb": args.object_store_mb, "autoscale": args.autoscale}
    head_cpus = args.cpus_per_node if args.head_cpus is None else args.head_cpus
    if args.autoscale:
        write_autoscaling_config(root, state, args, head_cpus)
    nodes = 0 if args.autoscale else 1 if args.nodes is None else args.nodes
    workers = [(f"worker{i}", args.cpus_per_node, args.gpus_per_node) for i in range(1, nodes + 1)]
    head_gpus = 0 if args.autoscale else args.gpus_per_node  # the head runs no trials
    try:
        start_nodes(root, state, [("head", head_cpus, head_gpus)], args.timeout)
        if workers:  # once the head is up: they join it
            start_nodes(root, state, workers, args.timeout)
    except BaseException:
        for node in reversed(state["nodes"]):
            stop_node(node, 5.0)
        shutil.rmtree(temp_root, ignore_errors=True)
        raise
    (root / "env.sh").write_text(state["exports"] + "\n")
    cpus = sum(n["cpus"] for n in state["nodes"])
    what = f"{nodes} worker node(s), {cpus} CPUs in all"
    if args.autoscale:
        what = f"autoscaling to {args.autoscale} worker node(s) of {args.cpus_per_node} CPU(s) "
        what += f"(idle ones go after {args.idle_timeout_s:g}s), {cpus} CPUs in all now"
    dashboard = state["nodes"][0]["ports"]["dashboard"]
    print(
        f"Ray cluster up: head + {what}, token auth on; state in {root}\n"
        f"Client environment (or: source {shlex.quote(str(root / 'env.sh'))}):\n  {state['exports']}\n"
        f"Then, for example:\n  gptrun sweep experiments/configs/quickstart.toml --address {state['address']}"
        f" --storage $PWD/sweeps\nDashboard (this machine only, token required): http://{LOOPBACK}:{dashboard}\n"
        "Stop it: cluster/local.sh down" + (f" --dir {root}" if args.dir else "")
    )
    return 0


def cmd_status(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root)
    dashboard = state["nodes"][0]["ports"]["dashboard"]
    print(f"address   {state['address']}   dashboard http://{LOOPBACK}:{dashboard}")
    print(f"token     {state['token_path']}   state {root}")
    try:
        known = {g["port"]: g for g in gcs_nodes(state)}
    except ClusterError as err:
        known = {}
        print(f"head      {err}")
    print(f"{'node':<10} {'pid':>8} {'procs':>5}  {'ray':<6} {'CPU':>4} {'GPU':>4}  node id")
    for node in state["nodes"]:
        node["procs"] = len(session(node))
        g = known.get(node["ports"]["node-manager"], {"resources": {}})
        ray = {True: "alive", False: "dead"}.get(g.get("alive"), "-")
        cpu, gpu = (g["resources"].get(key, 0) for key in ("CPU", "GPU"))
        row = f"{node['name']:<10} {node['pid']:>8} {node['procs']:>5}  {ray:<6} {cpu:>4g} {gpu:>4g}"
        print(f"{row}  {node.get('node_id', '?')}")
    alive = [g for g in known.values() if g["alive"]]
    cpus, gpus = (sum(g["resources"].get(key, 0) for g in alive) for key in ("CPU", "GPU"))
    print(f"alive: {len(alive)} node(s), {cpus:g} CPUs, {gpus:g} GPUs")
    return 0 if all(n["procs"] for n in state["nodes"]) and len(alive) == len(state["nodes"]) else 1


def cmd_down(args: argparse.Namespace, root: Path) -> int:
    if (state := load_state(root, required=False)) is None:
        print(f"no cluster state in {root}: nothing to stop")
        return 0
    # Workers first, the head (GCS) last.
    if left := {n["name"]: rest for n in reversed(state["nodes"]) if (rest := stop_node(n, args.grace))}:
        raise ClusterError(f"processes still alive after SIGKILL: {left}")
    if not args.keep_logs:
        shutil.rmtree(state["temp_root"], ignore_errors=True)
    for name in ("state.json", "token", "env.sh"):
        (root / name).unlink(missing_ok=True)
    print(f"Ray cluster {state['address']} down: {len(state['nodes'])} node(s) stopped, no process left")
    return 0


def cmd_kill_node(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root)
    if not (node := next((n for n in state["nodes"] if n["name"] == args.name), None)):
        raise UserError(f"no node {args.name!r}; nodes: {', '.join(n['name'] for n in state['nodes'])}")
    if node["head"]:
        raise UserError("kill-node is for worker nodes; `down` stops the head")
    count = len(session(node))
    if left := stop_node(node, 5.0, signal.SIGKILL):
        raise ClusterError(f"node {args.name}: processes {left} survived SIGKILL")
    print(f"node {args.name} killed ({count} processes, SIGKILL)")
    return 0


def cmd_start_node(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root)
    if state["port"] not in tcp_ports(psutil.CONN_LISTEN):
        raise ClusterError(f"the head at {state['address']} is down; `down` then `up`")
    if args.name == "head":
        raise ClusterError("the head cannot be restarted alone; `down` then `up`")
    old = next((n for n in state["nodes"] if n["name"] == args.name), None)
    if old and session(old):
        raise ClusterError(f"node {args.name} is running; kill-node it first")
    cpus = args.cpus or (old or state["nodes"][-1])["cpus"]
    start_nodes(root, state, [(args.name, cpus, old["gpus"] if old else 0)], args.timeout)
    print(f"node {args.name} started ({cpus} CPUs), node id {state['nodes'][-1]['node_id']}")
    return 0


def cmd_env(args: argparse.Namespace, root: Path) -> int:
    print(load_state(root)["exports"])
    return 0


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", help="state folder (default: $GPTRUN_CLUSTER_DIR or ./.cluster)")
    parser = OneLineParser(prog="cluster/local.sh", description="A multi-node Ray cluster on this machine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", parents=[common], help="start a head and N worker nodes")
    up.add_argument("--nodes", type=whole(0), help="worker nodes besides the head (1)")
    up.add_argument("--cpus-per-node", type=whole(1), default=1, help="logical CPUs per node (1)")
    up.add_argument("--head-cpus", type=whole(0), help="logical CPUs of the head (--cpus-per-node)")
    up.add_argument("--autoscale", type=whole(1), metavar="MAX", help="Ray's autoscaler adds up to MAX nodes")
    up.add_argument("--idle-timeout-s", type=SECONDS, default=60.0, help="an idle added node's life (60)")
    up.add_argument("--gpus-per-node", type=whole(0), default=0, help="logical GPUs per node (0)")
    up.add_argument("--port", type=PORT, help="GCS port (default: a free one)")
    up.add_argument("--object-store-mb", type=whole(80), default=256, help="object store per node")
    up.add_argument("--timeout", type=SECONDS, default=120.0, help="seconds to wait per step")
    sub.add_parser("status", parents=[common], help="address, nodes and resources")
    down = sub.add_parser("down", parents=[common], help="stop every process `up` started")
    down.add_argument("--grace", type=SECONDS, default=20.0, help="seconds between SIGTERM and SIGKILL (20)")
    down.add_argument("--keep-logs", action="store_true", help="keep Ray's session folders")
    sub.add_parser("kill-node", parents=[common], help="SIGKILL a worker node").add_argument("name")
    start = sub.add_parser("start-node", parents=[common], help="(re)start a worker node")
    start.add_argument("name")
    start.add_argument("--cpus", type=whole(1))
    start.add_argument("--timeout", type=SECONDS, default=120.0)
    sub.add_parser("env", parents=[common], help="print the client's export line")
    args = parser.parse_args(argv)
    root = Path(args.dir or os.environ.get("GPTRUN_CLUSTER_DIR") or ".cluster").expanduser().resolve()
    try:
        return globals()["cmd_" + args.command.replace("-", "_")](args, root)
    except (ClusterError, UserError) as err:
        print(f"cluster/local.sh {args.command}: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UserError) else 1
    except KeyboardInterrupt:
        print(f"cluster/local.sh {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
