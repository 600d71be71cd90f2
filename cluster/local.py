"""A multi-node Ray cluster on one machine: a head plus N worker nodes, token auth on.

Run it through `cluster/local.sh` (same arguments):

    cluster/local.sh up [--nodes N] [--cpus-per-node C] [--head-cpus C] [--gpus-per-node G]
    cluster/local.sh up --autoscale MAX [--cpus-per-node C] [--head-cpus 0] [--idle-timeout-s S]
    cluster/local.sh status
    cluster/local.sh down
    cluster/local.sh kill-node NAME       # SIGKILL one worker node (a lost machine), for tests
    cluster/local.sh start-node NAME      # start a killed (or new) worker node again
    cluster/local.sh env                  # the export lines a client needs

Every node is its own `ray start --block` in its own session (setsid): its own raylet, object
store, temp/session folder and ports, so it behaves like a separate machine that happens to share
the loopback interface and the disk. `down` signals exactly those sessions (SIGTERM, then SIGKILL
after a grace period) and checks that none of their processes is left; it never touches another
Ray instance on the machine.

State lives in --dir, or $GPTRUN_CLUSTER_DIR, or ./.cluster: `state.json` (address, pids,
sessions, ports), `token` (mode 0600, shared by every node and client), `env.sh` (the exports),
`logs/NAME.log` (each `ray start`'s output). Ray's own session folders go under a short folder in
$TMPDIR (Unix socket paths are limited to 107 bytes) and are deleted by `down` (--keep-logs keeps
them).

Ray 2.60 reads RAY_AUTH_MODE=token and the token from RAY_AUTH_TOKEN (highest precedence),
RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token. Every node is started with RAY_AUTH_MODE=token and
RAY_AUTH_TOKEN_PATH pointing at the state's token file, and RAY_AUTH_TOKEN removed from its
environment so that a stray value cannot override the file.

`up --autoscale MAX` starts an autoscaling cluster instead: the head runs Ray's autoscaler with
its fake multi-node provider (the one Ray's own autoscaler tests use), which adds up to MAX worker
nodes of `--cpus-per-node` CPUs when work is pending or `request_resources` asks, and removes them
after `--idle-timeout-s` idle. The added nodes are processes of the head's session, so `down`
stops them with it. The autoscaling config is `autoscaler.yaml` in the state folder.

Linux only (it reads /proc). Standard library only, plus the `ray` of this Python.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
STATE_FILE = "state.json"
TOKEN_FILE = "token"
STARTED = "Ray runtime started."
AUTOSCALER_FILE = "autoscaler.yaml"
WORKER_TYPE = "ray.worker.cpu"
EMPTY_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
    "cluster_synced_files",
    "rsync_exclude",
    "rsync_filter",
)


class ClusterError(Exception):
    """One line for the user; exit status 1."""


class UsageError(ClusterError):
    """Bad input: one line for the user; exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2) rather than the usage text and the line."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def port_number(text: str) -> int:
    """A TCP port; Ray would take 99999 modulo 65536 and listen elsewhere than it prints."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def whole_number(low: int) -> typing.Callable[[str], int]:
    """The type of a count option (nodes, CPUs, GPUs, MB): a whole number >= `low`, refused
    here rather than by `ray start` once the head runs (exit 1, a log to read)."""

    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= {low}")
        return int(text)

    return parse


def seconds(text: str) -> float:
    """The type of a time option: float() takes 'nan', which passes a '<= 0' check."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused just below, with the same line
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds > 0")
    return value


# ---------------------------------------------------------------- state


def state_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("GPTRUN_CLUSTER_DIR") or ".cluster").expanduser().resolve()


def load_state(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / STATE_FILE).read_text())
    except FileNotFoundError:
        return None


def save_state(root: Path, state: dict[str, Any]) -> None:
    tmp = root / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, root / STATE_FILE)


def write_token(path: Path) -> None:
    """A fresh 256-bit token, created with mode 0600 (never readable by others, not even briefly)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def client_exports(state: dict[str, Any]) -> str:
    return (
        f"export RAY_ADDRESS={state['address']} RAY_AUTH_MODE=token "
        f"RAY_AUTH_TOKEN_PATH={shlex.quote(state['token_path'])}"
    )


def node_env(state: dict[str, Any], head: bool = False) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_path"], RAY_USAGE_STATS_ENABLED="0")
    if head and state.get("autoscale"):  # the fake provider's switch; an update every second
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    return env


# ---------------------------------------------------------------- processes (/proc)


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(session id, start time in clock ticks) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):  # a zombie has exited; its parent has not reaped it yet
        return None
    return int(fields[3]), int(fields[19])


def session_pids(node: dict[str, Any]) -> list[int]:
    """The live processes of a node: those in the session its `ray start` created.

    A process keeps its session id even when it changes process group (Ray puts workers in
    their own groups) or is re-parented after the leader died. If the leader's pid now belongs
    to another process (pid reuse after a reboot or a long time), the session is not ours."""
    sid = node["sid"]
    leader = proc_stat(sid)
    if leader is not None and leader[1] != node["start_ticks"]:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st and st[0] == sid and st[1] >= node["start_ticks"]:
                found.append(int(entry.name))
    return sorted(found)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(node: dict[str, Any], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = session_pids(node)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---------------------------------------------------------------- ports


def free_ports(n: int, taken: set[int]) -> list[int]:
    """`n` distinct ports that nothing listens on now (the OS picks them; a small race remains)."""
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in taken and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def listening(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- nodes


def ray_command() -> list[str]:
    beside = Path(sys.executable).with_name("ray")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def used_ports(state: dict[str, Any]) -> set[int]:
    taken = {state["port"], state["dashboard_port"], state["client_port"]}
    for node in state["nodes"]:
        taken.update(node["ports"].values())
    return taken


def write_autoscaling_config(root: Path, state: dict[str, Any], head_cpus: int) -> Path:
    """The autoscaler's cluster config for Ray's fake multi-node provider: a head of the given
    CPUs and one worker type (`cpus` CPUs, `gpus` GPUs, min 0, max `max_workers`). The provider
    must be told the head's GCS address: without it the nodes it starts dial port 6379."""
    autoscale = state["autoscale"]
    head_resources = {"CPU": head_cpus, "GPU": 0}
    worker = {"CPU": autoscale["cpus"], "GPU": autoscale["gpus"]}
    config = {
        "cluster_name": f"gptrun-local-{state['port']}",
        "max_workers": autoscale["max_workers"],
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": autoscale["idle_timeout_s"] / 60,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": state["address"],
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": worker,
                "node_config": {},
                "min_workers": 0,
                "max_workers": autoscale["max_workers"],
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        **{key: [] for key in EMPTY_LISTS},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }
    path = root / AUTOSCALER_FILE
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def start_node(root: Path, state: dict[str, Any], name: str, cpus: int, gpus: int) -> dict:
    """Launch `ray start --block` for one node in a new session; return its record (not yet
    known to be up: see `wait_started`). On an autoscaling cluster the head also runs the
    autoscaler with the fake multi-node provider."""
    head = name == "head"
    keys = ("node_manager", "object_manager", "agent_listen", "agent_grpc", "runtime_env", "metrics")
    ports = dict(zip(keys, free_ports(len(keys), used_ports(state)), strict=True))
    temp_dir = Path(state["temp_root"]) / name
    temp_dir.mkdir(parents=True, exist_ok=True)
    args = [
        *ray_command(),
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        LOOPBACK,
        "--num-cpus",
        str(cpus),
        "--num-gpus",
        str(gpus),
        "--temp-dir",
        str(temp_dir),
        "--object-store-memory",
        str(state["object_store_mb"] * 1024 * 1024),
        "--node-manager-port",
        str(ports["node_manager"]),
        "--object-manager-port",
        str(ports["object_manager"]),
        "--dashboard-agent-listen-port",
        str(ports["agent_listen"]),
        "--dashboard-agent-grpc-port",
        str(ports["agent_grpc"]),
        "--runtime-env-agent-port",
        str(ports["runtime_env"]),
        "--metrics-export-port",
        str(ports["metrics"]),
        # 0/0: each worker process binds a port the OS picks, so the nodes' workers (and
        # other Ray instances on this machine) never compete for one fixed range.
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
    ]
    if head:
        args += [
            "--head",
            "--port",
            str(state["port"]),
            "--include-dashboard",
            "true",
            "--dashboard-host",
            LOOPBACK,
            "--dashboard-port",
            str(state["dashboard_port"]),
            "--ray-client-server-port",
            str(state["client_port"]),
        ]
        if state.get("autoscale"):
            args.append(f"--autoscaling-config={root / AUTOSCALER_FILE}")
    else:
        args += ["--address", state["address"]]
    log_path = root / "logs" / f"{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=node_env(state, head),
            start_new_session=True,
            cwd=root,
        )
    st = proc_stat(proc.pid)
    if st is None:
        raise ClusterError(f"`ray start` for node {name} exited at once; see {log_path}")
    return {
        "name": name,
        "head": head,
        "pid": proc.pid,
        "sid": proc.pid,
        "start_ticks": st[1],
        "cpus": cpus,
        "gpus": gpus,
        "ports": ports,
        "temp_dir": str(temp_dir),
        "log": str(log_path),
        "log_offset": log_path.stat().st_size,
    }


def wait_started(node: dict[str, Any], timeout: float) -> None:
    """Until the node's `ray start` prints that the runtime started; one line if it dies or
    takes too long (with the tail of its log)."""
    deadline = time.monotonic() + timeout
    log = Path(node["log"])
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(node.get("log_offset", 0))
            text = f.read().decode(errors="replace")
        if STARTED in text:
            return
        if proc_stat(node["pid"]) is None:
            tail = " | ".join(line.strip() for line in text.splitlines()[-4:] if line.strip())
            raise ClusterError(f"node {node['name']} failed to start ({tail}); log: {log}")
        time.sleep(0.3)
    raise ClusterError(f"node {node['name']} did not start within {timeout:g}s; log: {log}")


def gcs_nodes(state: dict[str, Any], timeout: float = 10.0) -> list[dict[str, Any]]:
    """The nodes the head's GCS knows, as dicts (alive ones and dead ones)."""
    if not listening(state["port"]):
        raise ClusterError(f"nothing listens at {state['address']}: the head is down")
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_path"])
    os.environ.pop("RAY_AUTH_TOKEN", None)
    from experiments.private_ray import gcs_node_infos

    nodes = []
    for info in gcs_node_infos(state["address"], timeout):
        nodes.append(
            {
                "node_id": info.node_id.hex(),
                "alive": info.state == 0,
                "port": info.node_manager_port,
                "head": info.is_head_node,
                "resources": dict(info.resources_total),
            }
        )
    return nodes


def wait_registered(state: dict[str, Any], names: list[str], timeout: float) -> None:
    """Until the GCS lists each named node as alive; records its Ray node id."""
    deadline = time.monotonic() + timeout
    by_port = {n["ports"]["node_manager"]: n for n in state["nodes"] if n["name"] in names}
    while True:
        alive = {g["port"]: g for g in gcs_nodes(state) if g["alive"]}
        if all(port in alive for port in by_port):
            for port, node in by_port.items():
                node["node_id"] = alive[port]["node_id"]
            return
        if time.monotonic() > deadline:
            missing = [n["name"] for p, n in by_port.items() if p not in alive]
            raise ClusterError(
                f"node(s) {', '.join(missing)} did not register with the head "
                f"within {timeout:g}s; see {Path(state['nodes'][0]['log']).parent}"
            )
        time.sleep(0.5)


def stop_node(node: dict[str, Any], grace: float) -> list[int]:
    """SIGTERM the node's `ray start` (it drains its raylet, workers, agents), then SIGKILL
    whatever of its session is left after `grace` seconds. Returns the pids still alive."""
    pids = session_pids(node)
    if not pids:
        return []
    if node["pid"] in pids:
        signal_all([node["pid"]], signal.SIGTERM)
    else:  # the leader is gone already (killed node): terminate the rest directly
        signal_all(pids, signal.SIGTERM)
    left = wait_gone(node, grace)
    if left:
        signal_all(left, signal.SIGKILL)
        left = wait_gone(node, 5.0)
    return left


# ---------------------------------------------------------------- commands


def cmd_up(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root)
    if state and any(session_pids(n) for n in state["nodes"]):
        raise ClusterError(
            f"a cluster from {root} is running ({state['address']}); "
            "`cluster/local.sh down` first, or use another --dir"
        )
    if args.nodes is None:
        args.nodes = 0 if args.autoscale else 1
    if args.autoscale is not None and args.nodes:
        raise UsageError("--autoscale MAX adds the worker nodes itself; leave --nodes out")
    if args.port and listening(args.port):
        raise UsageError(f"port {args.port} is in use; pick another --port or leave it out")
    head_cpus = args.cpus_per_node if args.head_cpus is None else args.head_cpus
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    token_path = root / TOKEN_FILE
    write_token(token_path)
    port = args.port or free_ports(1, set())[0]
    dashboard, client = free_ports(2, {port})
    temp_root = tempfile.mkdtemp(prefix="gptrun-ray-")  # short: Unix socket paths <= 107 bytes
    state = {
        "address": f"{LOOPBACK}:{port}",
        "port": port,
        "dashboard_port": dashboard,
        "client_port": client,
        "token_path": str(token_path),
        "temp_root": temp_root,
        "object_store_mb": args.object_store_mb,
        "python": sys.executable,
        "started_unix": time.time(),
        "nodes": [],
    }
    if args.autoscale:
        state["autoscale"] = {
            "max_workers": args.autoscale,
            "cpus": args.cpus_per_node,
            "gpus": args.gpus_per_node,
            "idle_timeout_s": args.idle_timeout_s,
        }
        write_autoscaling_config(root, state, head_cpus)
    save_state(root, state)
    try:
        head_gpus = 0 if args.autoscale else args.gpus_per_node  # the head runs no trials
        head = start_node(root, state, "head", head_cpus, head_gpus)
        state["nodes"].append(head)
        save_state(root, state)
        wait_started(head, args.timeout)
        for i in range(1, args.nodes + 1):
            state["nodes"].append(
                start_node(root, state, f"worker{i}", args.cpus_per_node, args.gpus_per_node)
            )
            save_state(root, state)
        for node in state["nodes"][1:]:
            wait_started(node, args.timeout)
        wait_registered(state, [n["name"] for n in state["nodes"]], args.timeout)
        save_state(root, state)
    except BaseException:
        for node in reversed(state["nodes"]):
            stop_node(node, 5.0)
        shutil.rmtree(temp_root, ignore_errors=True)
        raise
    (root / "env.sh").write_text(client_exports(state) + "\n")
    cpus = sum(n["cpus"] for n in state["nodes"])
    nodes = (
        f"autoscaling to {args.autoscale} worker node(s) of {args.cpus_per_node} CPU(s) "
        f"(idle ones go after {args.idle_timeout_s:g}s)"
        if args.autoscale
        else f"{args.nodes} worker node(s)"
    )
    now = " now" if args.autoscale else ""
    print(f"Ray cluster up: head + {nodes}, {cpus} CPUs in all{now}, token auth on; state in {root}")
    print("Client environment (or: source " + shlex.quote(str(root / "env.sh")) + "):")
    print(f"  {client_exports(state)}")
    print("Then, for example:")
    print(
        f"  gptrun sweep experiments/configs/quickstart.toml --address {state['address']} "
        "--storage $PWD/sweeps"
    )
    print(f"Dashboard (this machine only, token required): http://{LOOPBACK}:{dashboard}")
    print("Stop it: cluster/local.sh down" + (f" --dir {root}" if args.dir else ""))
    return 0


def cmd_status(args: argparse.Namespace, root: Path) -> int:
    state = require_state(root)
    print(f"address   {state['address']}   dashboard http://{LOOPBACK}:{state['dashboard_port']}")
    print(f"token     {state['token_path']}   state {root}")
    try:
        known = {g["port"]: g for g in gcs_nodes(state)}
    except ClusterError as err:
        known = {}
        print(f"head      {err}")
    running = 0
    print(f"{'node':<10} {'pid':>8} {'procs':>5}  {'ray':<6} {'CPU':>4} {'GPU':>4}  node id")
    for node in state["nodes"]:
        procs = len(session_pids(node))
        running += procs > 0
        g = known.get(node["ports"]["node_manager"])
        ray_state = "-" if g is None else ("alive" if g["alive"] else "dead")
        res = g["resources"] if g else {}
        print(
            f"{node['name']:<10} {node['pid']:>8} {procs:>5}  {ray_state:<6} "
            f"{res.get('CPU', 0):>4g} {res.get('GPU', 0):>4g}  {node.get('node_id', '?')}"
        )
    alive = [g for g in known.values() if g["alive"]]
    total = {k: sum(g["resources"].get(k, 0) for g in alive) for k in ("CPU", "GPU")}
    print(f"alive: {len(alive)} node(s), {total['CPU']:g} CPUs, {total['GPU']:g} GPUs")
    return 0 if running == len(state["nodes"]) and len(alive) == len(state["nodes"]) else 1


def cmd_down(args: argparse.Namespace, root: Path) -> int:
    state = load_state(root)
    if state is None:
        print(f"no cluster state in {root}: nothing to stop")
        return 0
    left: dict[str, list[int]] = {}
    for node in reversed(state["nodes"]):  # workers first, the head (GCS) last
        rest = stop_node(node, args.grace)
        if rest:
            left[node["name"]] = rest
    if left:
        raise ClusterError(f"processes still alive after SIGKILL: {left}")
    if not args.keep_logs:
        shutil.rmtree(state["temp_root"], ignore_errors=True)
    for name in (STATE_FILE, TOKEN_FILE, "env.sh"):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
    print(f"Ray cluster {state['address']} down: {len(state['nodes'])} node(s) stopped, no process left")
    return 0


def cmd_kill_node(args: argparse.Namespace, root: Path) -> int:
    state = require_state(root)
    node = find_node(state, args.name)
    if node["head"]:
        raise UsageError("kill-node is for worker nodes; `down` stops the head")
    pids = session_pids(node)
    signal_all(pids, signal.SIGKILL)
    left = wait_gone(node, 5.0)
    if left:
        raise ClusterError(f"node {args.name}: processes {left} survived SIGKILL")
    print(f"node {args.name} killed ({len(pids)} processes, SIGKILL)")
    return 0


def cmd_start_node(args: argparse.Namespace, root: Path) -> int:
    state = require_state(root)
    if not listening(state["port"]):
        raise ClusterError(f"the head at {state['address']} is down; `down` then `up`")
    old = next((n for n in state["nodes"] if n["name"] == args.name), None)
    if old and session_pids(old):
        raise ClusterError(f"node {args.name} is running; kill-node it first")
    if args.name == "head":
        raise ClusterError("the head cannot be restarted alone; `down` then `up`")
    cpus = args.cpus or (old["cpus"] if old else state["nodes"][-1]["cpus"])
    gpus = old["gpus"] if old else 0
    node = start_node(root, state, args.name, cpus, gpus)
    state["nodes"] = [n for n in state["nodes"] if n["name"] != args.name] + [node]
    save_state(root, state)
    wait_started(node, args.timeout)
    wait_registered(state, [args.name], args.timeout)
    save_state(root, state)
    print(f"node {args.name} started ({cpus} CPUs), node id {node['node_id']}")
    return 0


def cmd_env(args: argparse.Namespace, root: Path) -> int:
    print(client_exports(require_state(root)))
    return 0


def require_state(root: Path) -> dict[str, Any]:
    state = load_state(root)
    if state is None:
        raise ClusterError(
            f"no cluster state in {root}; start one with `cluster/local.sh up` "
            "(or pass --dir / set GPTRUN_CLUSTER_DIR)"
        )
    return state


def find_node(state: dict[str, Any], name: str) -> dict[str, Any]:
    for node in state["nodes"]:
        if node["name"] == name:
            return node
    raise UsageError(f"no node {name!r}; nodes: {', '.join(n['name'] for n in state['nodes'])}")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir", default=None, help="state folder (default: $GPTRUN_CLUSTER_DIR or ./.cluster)"
    )
    p = OneLineParser(
        prog="cluster/local.sh",
        description="A multi-node Ray cluster on this machine (token auth, dashboard on 127.0.0.1).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", parents=[common], help="start a head and N worker nodes")
    up.add_argument("--nodes", type=whole_number(0), default=None, help="worker nodes besides the head (1)")
    up.add_argument("--cpus-per-node", type=whole_number(1), default=1, help="logical CPUs per node (1)")
    up.add_argument(
        "--head-cpus",
        type=whole_number(0),
        default=None,
        help="logical CPUs of the head (default: --cpus-per-node)",
    )
    up.add_argument(
        "--autoscale",
        type=whole_number(1),
        default=None,
        metavar="MAX",
        help="an autoscaling cluster: no worker node at first, up to MAX added by Ray's autoscaler "
        "(fake multi-node provider) when work waits",
    )
    up.add_argument(
        "--idle-timeout-s",
        type=seconds,
        default=60.0,
        help="with --autoscale: seconds before an idle node is removed (60)",
    )
    up.add_argument(
        "--gpus-per-node",
        type=whole_number(0),
        default=0,
        help="logical GPUs per node (0; on one machine the nodes share the devices)",
    )
    up.add_argument("--port", type=port_number, default=None, help="GCS port (default: a free one)")
    up.add_argument("--object-store-mb", type=whole_number(80), default=256, help="object store per node")
    up.add_argument("--timeout", type=seconds, default=120.0, help="seconds to wait per step")
    sub.add_parser("status", parents=[common], help="address, nodes and resources")
    down = sub.add_parser("down", parents=[common], help="stop every process `up` started")
    down.add_argument("--grace", type=seconds, default=20.0, help="seconds between SIGTERM and SIGKILL (20)")
    down.add_argument("--keep-logs", action="store_true", help="keep Ray's session folders")
    kill = sub.add_parser("kill-node", parents=[common], help="SIGKILL a worker node")
    kill.add_argument("name")
    start = sub.add_parser("start-node", parents=[common], help="(re)start a worker node")
    start.add_argument("name")
    start.add_argument("--cpus", type=whole_number(1), default=None)
    start.add_argument("--timeout", type=seconds, default=120.0)
    sub.add_parser("env", parents=[common], help="print the client's export line")
    return p


COMMANDS = {
    "up": cmd_up,
    "status": cmd_status,
    "down": cmd_down,
    "kill-node": cmd_kill_node,
    "start-node": cmd_start_node,
    "env": cmd_env,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, state_dir(args.dir))
    except ClusterError as err:
        print(f"cluster/local.sh {args.command}: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    except KeyboardInterrupt:
        print(f"cluster/local.sh {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
