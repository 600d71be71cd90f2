"""Getting a Ray cluster: start a local one or join `--address`, fail fast with one line when the
address is dead, is not a Ray cluster, refuses our token, or is too small (Ray itself would retry
for tens of seconds or wait forever).

Storage is checked in two steps so that nothing is written before the cluster answers:
`check_storage` (pure: resolves and validates, creates nothing) before `ray_session`, then
`create_storage` inside it; on a multi-node cluster `verify_shared_storage` checks that every
node sees a local path (NFS) before any trial writes there, and `verify_trial_nodes` that every
node that runs trials has the driver's gptrun, Ray and torch, and the prepared data.dir."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.private_ray import (
    reload_ray_auth,
    resolve_auto_address,
    submitted_job_env_vars,
    token_header,
)
from gptcore.errors import UserError

PROBE_TIMEOUT_S = 10.0  # the gRPC probe's own cap (RESOURCE_WAIT_S bounds it further)
# Cheap, read-only RPCs that every Ray 2.x head serves: the GCS's cluster id, and the Ray Client
# server's cluster info (for ray:// addresses). The request bodies are empty protobufs.
GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
CLIENT_PROBE = "/ray.rpc.RayletDriver/ClusterInfo"
TOKEN_HINT = (
    "export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<the cluster's token file> "
    "(`cluster/local.sh env` prints the line for a local cluster)"
)


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds from the environment (e.g. GPTRUN_RESOURCE_WAIT_S), read when it is
    needed so that a bad value is one line from the command that uses it, not a traceback at
    import."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise UserError(f"{name}={raw!r} is not a number of seconds; write e.g. {name}={default:g}")
    return value


def resource_wait_s() -> float:
    """How long a static cluster may take to show the resources a command needs (default 20 s)."""
    return env_seconds("GPTRUN_RESOURCE_WAIT_S", 20.0)


def autoscale_wait_s() -> float:
    """How long an autoscaler may take to bring up the nodes of a first trial (default 600 s:
    cloud nodes take minutes to boot)."""
    return env_seconds("GPTRUN_AUTOSCALE_WAIT_S", 600.0)


def resolve_address(address: str | None) -> str | None:
    """`--address`, else `$RAY_ADDRESS` (Ray's own convention, which `cluster/local.sh up`
    prints), else None: start a local instance. The CLI resolves it once, before any check, and
    hands the result to every step (local resource checks, the storage check, `ray_session`)."""
    return address or os.environ.get("RAY_ADDRESS") or None


# Settings gptrun puts in the driver's os.environ for Ray Train (here and in `experiments.cli`).
# Ray Train reads them in the process that calls `fit`, a DDP trial's Tune actor, and passes them
# on to its controller and workers; on a cluster that actor has its raylet's environment, not the
# driver's, so the job's runtime_env carries them to every process of the job.
TRAIN_SETTINGS = (
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
    "RAY_TRAIN_ENABLE_PRINT_PATCH",
)


def job_runtime_env() -> dict[str, Any]:
    """The runtime_env of gptrun's Ray job: the Ray Train settings set in this process, and the
    hook that tells each worker which cluster it is in (`point_at_own_cluster`). Under
    `ray job submit` (a KubeRay RayJob) the job's own runtime_env reaches every process already,
    and `ray.init` refuses a second value for any variable it sets, even an equal one (the
    submitter also puts them in this process's environment): those are left to it."""
    theirs = submitted_job_env_vars()
    return {
        "env_vars": {
            name: os.environ[name] for name in TRAIN_SETTINGS if name in os.environ and name not in theirs
        },
        "worker_process_setup_hook": "experiments.cluster.point_at_own_cluster",
    }


def point_at_own_cluster() -> None:
    """Set $RAY_ADDRESS in a Ray worker of gptrun's job to the cluster the worker belongs to.

    Ray Train's placement-group cleaner asks Ray's state API about its controller with no
    address, and Ray then finds "the" cluster from $RAY_ADDRESS, else by the GCS processes on
    the machine: beside a second Ray (another user's `ray start`, a test cluster) that fails with
    "Found multiple active Ray instances", or picks the other one. The cleaner's thread dies, the
    finished DDP trial's CPUs are never given back, and the next trial waits for them forever."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


@contextlib.contextmanager
def ray_session(address: str | None = None, extra_local_cpus: int = 0) -> Iterator[None]:
    """`ray.init` for the duration of a command; always shut down what we started.

    An address (or $RAY_ADDRESS) is probed first, bounded by GPTRUN_RESOURCE_WAIT_S
    (`check_cluster`). `extra_local_cpus` adds logical CPUs to a local instance for processes
    that only wait (the sweep's trial functions, 0.01 CPU each), so that N cores still run N
    one-CPU trials."""
    import ray

    resource_wait_s(), autoscale_wait_s()  # a bad value is one line, before Ray starts
    if ray.is_initialized():  # a caller (a test, a notebook) already holds a session: share it
        yield
        return
    address = resolve_address(address)
    if address is not None:
        address = check_cluster(address)
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    # Ray Train gives a worker group 60 s to start. On a busy machine (or while the previous
    # trial's workers are still shutting down) that is too little, and a timed-out start leaks its
    # placement group, which then starves every later trial.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "900")
    with contextlib.ExitStack() as local_token:  # removed after Ray has shut down
        try:
            if address is None:  # "local": never attach to another `ray start` on this machine
                local_token.enter_context(private_token())
                ray.init(
                    address="local",
                    runtime_env=job_runtime_env(),
                    num_cpus=(os.cpu_count() or 1) + extra_local_cpus,
                    # The dashboard serves Ray's state API, which Ray Train's placement-group
                    # cleaner needs: without it a trial that ASHA stops leaks its CPUs/GPUs.
                    include_dashboard=True,
                    dashboard_host="127.0.0.1",
                    logging_level="warning",
                    configure_logging=True,
                    log_to_driver=True,
                )
            else:
                ray.init(address=address, logging_level="warning", runtime_env=job_runtime_env())
        except ConnectionError as err:
            raise UserError(
                f"could not connect to a Ray cluster at {address!r} ({err}); start one "
                "with `ray start --head` or pass the right --address"
            ) from None
        try:
            yield
        finally:
            ray.shutdown()


AUTH_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@contextlib.contextmanager
def private_token() -> Iterator[None]:
    """Token auth for the local Ray a command starts, with a token only its owner can read.

    Ray 2.60 turns token auth on for a new local instance, but writes the token it generates to
    `~/.ray/auth_token` with the umask's mode (0644 on most machines): on a machine where home
    folders are readable by others, any local user could read it, connect, and run code as the
    sweep's owner. gptrun writes a fresh 256-bit token of its own, mode 0600 in a 0700 folder,
    points Ray at it (RAY_AUTH_TOKEN_PATH, inherited by every process of that Ray), and deletes
    it when the command ends. Where the user chose (any of `AUTH_SETTINGS` set), Ray's own
    settings are left as they are."""
    if any(os.environ.get(name) for name in AUTH_SETTINGS):
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="gptrun-ray-token-"))  # mode 0700
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    reload_ray_auth()
    try:
        yield
    finally:
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
            os.environ.pop(name, None)
        reload_ray_auth()
        path.unlink(missing_ok=True)
        folder.rmdir()


def check_cluster(address: str, timeout: float | None = None) -> str:
    """Probe `address` the way `ray.init` will use it, within `timeout` seconds (default: the
    smaller of GPTRUN_RESOURCE_WAIT_S and 10 s), and return it in the form to pass to
    `ray.init` ('auto' resolved to host:port).

    Raises a one-line UserError when nothing listens there, when what listens is not a Ray head
    (an HTTP server, the dashboard port, a raylet), or when the head refuses this client's
    token. `ray.init` itself retries such addresses for 20-60 s and then says only "Failed to
    connect"; a non-Ray port can keep it retrying far longer."""
    timeout = min(PROBE_TIMEOUT_S, resource_wait_s()) if timeout is None else timeout
    deadline = time.monotonic() + max(timeout, 1.0)
    if address == "auto":
        address = _resolve_auto()
    client = address.startswith("ray://")
    host, port = _split_address(address)
    try:
        with socket.create_connection((host, port), timeout=max(1.0, timeout / 2)):
            pass
    except OSError as err:
        raise UserError(
            f"nothing answers at --address {address} ({err.strerror or err}); check "
            "the address or start the cluster with `ray start --head`"
        ) from None
    metadata, credentials = _auth_metadata(), tls_credentials()
    code, details = _grpc_probe(
        f"{host}:{port}",
        CLIENT_PROBE if client else GCS_PROBE,
        metadata,
        credentials,
        max(0.5, deadline - time.monotonic()),
    )
    if code is None or (client and code not in _NOT_RAY and code != "UNAUTHENTICATED"):
        return address
    if code == "UNAUTHENTICATED":
        why = (
            "the token sent does not match"
            if metadata
            else "no token sent: RAY_AUTH_MODE is not 'token' here"
        )
        raise UserError(f"the Ray cluster at {address} refused this client ({why}); {TOKEN_HINT}")
    if code == "DEADLINE_EXCEEDED":
        raise UserError(
            f"the server at --address {address} did not answer a Ray request within "
            f"{timeout:g}s (GPTRUN_RESOURCE_WAIT_S); is the head overloaded, or is "
            "this not a Ray head?"
        )
    if code == "UNAVAILABLE" and credentials is None and _speaks_tls(host, port, timeout):
        raise UserError(
            f"the Ray head at --address {address} uses TLS and this client does not; set "
            f"RAY_USE_TLS=1 and {', '.join(TLS_FILES)} to the cluster's certificate files"
        )
    if code == "UNIMPLEMENTED":
        kind = "a gRPC service that is not the Ray head (a raylet or another service?)"
    elif code == "UNAVAILABLE":
        kind = "not a Ray head (it does not speak gRPC: a web server, or the dashboard port?)"
    else:
        kind = f"not a Ray head ({details})"
    port_hint = (
        "the Ray Client port (10001 by default)"
        if client
        else "the head's GCS port (`ray start --head --port`, 6379 by default)"
    )
    raise UserError(f"something answers at --address {address} but it is {kind}; give {port_hint}")


_NOT_RAY = {"UNAVAILABLE", "UNIMPLEMENTED", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"}


def _resolve_auto() -> str:
    try:
        return resolve_auto_address()
    except ConnectionError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no cluster found"
        raise UserError(f"--address auto: {first}") from None


def check_address(address: str | None) -> None:
    """One line, before anything runs, for an address that is neither 'auto' nor host:port."""
    if address not in (None, "auto"):
        _split_address(address)


def _split_address(address: str) -> tuple[str, int]:
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} is not 'auto', 'host:port' or 'ray://host:port'")
    return host.strip("[]"), int(port)


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    """The authorization header `ray.init` will send (`private_ray.token_header`); one line
    when RAY_AUTH_MODE=token asks for a token that is not there."""
    header, wanted = token_header()
    if header is None and wanted:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH")
        where = (
            f"RAY_AUTH_TOKEN_PATH={path} is missing or empty"
            if path
            else "no RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
        )
        raise UserError(f"RAY_AUTH_MODE=token is set but there is no token ({where}); " + TOKEN_HINT)
    return tuple((header or {}).items())


TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def tls_credentials() -> Any:
    """gRPC channel credentials from Ray's TLS settings, as `ray.init` uses them: None unless
    RAY_USE_TLS is on (then the certificate, key and CA files must all be readable: one line
    where one is not)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return None
    import grpc

    missing = [name for name in TLS_FILES if not os.environ.get(name)]
    if missing:
        raise UserError(
            f"RAY_USE_TLS is on but {', '.join(missing)} is not set; set all of {', '.join(TLS_FILES)}"
        )
    try:
        cert, key, ca = (Path(os.environ[name]).read_bytes() for name in TLS_FILES)
    except OSError as err:
        raise UserError(f"RAY_USE_TLS is on but {err.filename} cannot be read ({err.strerror})") from None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server at host:port answers a TLS handshake (a Ray head started with
    RAY_USE_TLS=1 does; one without TLS answers gRPC's plain HTTP/2 instead)."""
    import ssl

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=max(1.0, timeout / 2)) as raw,
            context.wrap_socket(raw),
        ):
            return True
    except ssl.SSLError as err:  # a TLS server that wants a client certificate still spoke TLS
        return "WRONG_VERSION_NUMBER" not in str(err) and "record layer" not in str(err)
    except OSError:
        return False


def _grpc_probe(
    target: str, method: str, metadata: tuple[tuple[str, str], ...], credentials: Any, timeout: float
) -> tuple[str | None, str]:
    """One unary call with an empty request, over TLS where `credentials` are given: (None, "")
    if the server answered it, else the gRPC status code name and its details (first line)."""
    import grpc

    opened = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with opened as channel:
        call = channel.unary_unary(
            method, request_serializer=lambda _: b"", response_deserializer=lambda raw: raw
        )
        try:
            call(None, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            details = (err.details() or "").strip().splitlines()
            return err.code().name, (details[0] if details else err.code().name)[:200]
    return None, ""


def local_resources(extra_cpus: int = 0) -> tuple[float, float]:
    """What a local instance started by `ray_session` will have: (CPUs, GPUs)."""
    import torch

    return float((os.cpu_count() or 1) + extra_cpus), float(torch.cuda.device_count())


def check_fits(cpus: float, gpus: float, what: str, have: tuple[float, float], waited: str = "") -> None:
    if have[0] >= cpus and have[1] >= gpus:
        return
    raise UserError(
        f"{what} needs {cpus:g} CPUs and {gpus:g} GPUs but the cluster has "
        f"{have[0]:g} CPUs and {have[1]:g} GPUs{waited}; lower --workers / "
        "--gpus-per-worker or add nodes"
    )


def require_resources(cpus: float, gpus: float, what: str) -> None:
    """Wait (bounded) until the cluster could ever fit `cpus`/`gpus`, else one clear line."""
    wait_s = resource_wait_s()
    deadline = time.monotonic() + wait_s
    while True:
        have = cluster_size()
        if time.monotonic() > deadline:
            check_fits(cpus, gpus, what, have, f" (waited {wait_s:g}s)")
        if have[0] >= cpus and have[1] >= gpus:
            return
        time.sleep(1.0)


def cluster_size() -> tuple[float, float]:
    """The CPUs and GPUs of the nodes alive now (needs a Ray session)."""
    import ray

    total = ray.cluster_resources()
    return total.get("CPU", 0.0), total.get("GPU", 0.0)


def check_storage(storage: str | None, default: str) -> str:
    """`--storage` (or `default`) as an absolute local path or an s3:// / gs:// URI whose bucket
    exists. Creates nothing (call `create_storage` once the cluster has answered), so a bad
    --address or a too-small cluster leaves no folder behind."""
    storage = storage or default
    if "://" in storage:
        from experiments.remote import check_bucket, filesystem

        try:
            filesystem(storage)  # a scheme gptrun opens, a URI pyarrow reads
            if not is_local(storage):  # read-only: the bucket exists, the credentials are accepted
                check_bucket(storage)
        except UserError as err:
            raise UserError(f"--storage {err}") from None
        return storage
    path = Path(storage).expanduser().resolve()
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                what = f"{path} is a file" if parent == path else f"{path}: {parent} is a file"
                raise UserError(f"--storage {what}; give a folder or a URI")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"--storage {path}: {parent} is not writable")
            break
    return str(path)


def create_storage(storage: str) -> None:
    """Create a local storage folder checked by `check_storage` (URIs need nothing: Ray and
    pyarrow create their prefixes)."""
    if is_local(storage):
        try:
            Path(storage.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"--storage {storage}: {err.strerror or err}") from None


def verify_shared_storage(storage: str, timeout: float | None = None) -> None:
    """On a multi-node cluster, check that every alive node sees the local path `storage`
    (an NFS mount at the same path), by writing a marker here and reading it from a zero-CPU
    task pinned to each node. One line naming the nodes that do not see it, instead of trials
    that checkpoint to their own disks and cannot be resumed elsewhere. Needs an initialized
    Ray session and an existing `storage` folder; URIs and one-node clusters are skipped."""
    import ray

    if not is_local(storage):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    timeout = resource_wait_s() if timeout is None else timeout
    folder = Path(storage.removeprefix("file://"))
    nonce = secrets.token_hex(8)
    marker = folder / f".gptrun-shared-check-{nonce}"
    marker.write_text(nonce)
    try:
        answers, pending = ask_each_node(_read_marker, str(marker), nodes, timeout)
    finally:
        marker.unlink(missing_ok=True)
    blind = [node for node, seen in answers if seen != nonce]
    if blind:
        raise UserError(
            f"--storage {storage} is not shared: node(s) {node_names(blind)} do not see it; use "
            "a folder every node mounts at the same path (NFS) or an s3:// / gs:// "
            "URI (`gptrun train`)"
        )
    if pending:
        print(
            f"warning: {pending} node(s) did not answer the shared-storage check within "
            f"{timeout:g}s; not checked"
        )


def verify_trial_nodes(data_dir: str, timeout: float | None = None) -> None:
    """Check that every alive node that can run a trial (one with CPUs) runs the driver's gptrun,
    Ray and torch, and has the prepared data folder `data_dir` whole, at the same path: the
    driver checked its own copy only. One line naming a node that differs, instead of trials
    that fail late and oddly there (a pickled class that moved, a checkpoint another torch
    cannot read) or are retried without their data. Needs an initialized Ray session; skipped
    where the only such node is this one."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    here = ray.get_runtime_context().get_node_id()
    if all(n["NodeID"] == here for n in nodes):
        return
    timeout = resource_wait_s() if timeout is None else timeout
    answers, pending = ask_each_node(_node_report, data_dir, nodes, timeout)
    ours = versions()
    for node, report in answers:
        differ = [f"{name} {v}" for name, v in report["versions"].items() if v != ours[name]]
        if differ:
            mine = ", ".join(f"{name} {ours[name]}" for name in ours)
            raise UserError(
                f"node {node_names([node])} runs {', '.join(differ)}, this driver {mine}; install "
                "the same gptrun, ray and torch on every node"
            )
    missing = [(node, report["data"]) for node, report in answers if report["data"]]
    if missing:
        raise UserError(
            f"data.dir {data_dir} is not usable on node(s) {node_names([n for n, _ in missing])} "
            f"({missing[0][1]}); put the prepared folder at the same path on every node that runs "
            "trials (a shared mount, or a copy)"
        )
    if pending:
        print(f"warning: {pending} node(s) did not answer the data check within {timeout:g}s; not checked")


def versions() -> dict[str, str]:
    """gptrun's, Ray's and torch's versions in this process's environment; torch's without its
    build label (`2.13.0+cpu` on a CPU head, `+cu128` on a GPU node: the same torch)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("gptrun", "ray", "torch"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "(not installed)"
    found["torch"] = found["torch"].split("+")[0]
    return found


def _node_report(data_dir: str) -> dict[str, Any]:
    return {"versions": versions(), "data": _data_problem(data_dir)}


def ask_each_node(fn: Any, arg: str, nodes: list[dict[str, Any]], timeout: float) -> tuple[list, int]:
    """`fn(arg)` in a zero-CPU task pinned to each of `nodes`: (node, answer) for those that
    answered within `timeout` seconds, and how many did not (their tasks are cancelled)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            arg
        ): n
        for n in nodes
    }
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    for ref in pending:  # a node that does not answer must not keep a task queued for it
        ray.cancel(ref, force=True)
    answers = []
    for ref in ready:
        try:
            answers.append((refs[ref], ray.get(ref)))
        except Exception:  # the node died meanwhile: the sweep's fault tolerance handles it
            continue
    return answers, len(pending)


def node_names(nodes: list[dict[str, Any]]) -> str:
    return ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in nodes)


def _data_problem(data_dir: str) -> str:
    """'' where the prepared folder opens whole on this node, else what is wrong with it."""
    from gptcore.chat_data import open_prepared

    try:
        open_prepared(data_dir)
    except (UserError, OSError, ValueError) as err:
        return str(err)
    return ""


def _read_marker(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def is_local(storage: str) -> bool:
    return "://" not in storage or storage.startswith("file://")
