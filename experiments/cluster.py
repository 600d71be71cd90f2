"""Getting a Ray cluster: start a local one or join `--address`, fail fast with one line when the
address is dead or the cluster is too small (Ray itself would retry or wait forever)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs

from gptcore.errors import UserError

RESOURCE_WAIT_S = float(os.environ.get("GPTRUN_RESOURCE_WAIT_S", "20"))


@contextlib.contextmanager
def ray_session(address: str | None = None, extra_local_cpus: int = 0) -> Iterator[None]:
    """`ray.init` for the duration of a command; always shut down what we started.

    `extra_local_cpus` adds logical CPUs to a local instance for processes that only wait (the
    sweep's trial functions, 0.01 CPU each), so that N cores still run N one-CPU trials."""
    import ray

    if ray.is_initialized():  # a caller (a test, a notebook) already holds a session: share it
        yield
        return
    if address is not None:
        _check_reachable(address)
    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    # Ray Train gives a worker group 60 s to start. On a busy machine (or while the previous
    # trial's workers are still shutting down) that is too little, and a timed-out start leaks its
    # placement group, which then starves every later trial.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "900")
    try:
        if address is None:
            ray.init(num_cpus=(os.cpu_count() or 1) + extra_local_cpus,
                     # The dashboard serves Ray's state API, which Ray Train's placement-group
                     # cleaner needs: without it a trial that ASHA stops leaks its CPUs/GPUs.
                     include_dashboard=True, dashboard_host="127.0.0.1", logging_level="warning",
                     configure_logging=True, log_to_driver=True)
        else:
            ray.init(address=address, logging_level="warning")
    except ConnectionError as err:
        raise UserError(f"could not connect to a Ray cluster at {address!r} ({err}); start one "
                        "with `ray start --head` or pass the right --address") from None
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """A TCP probe with a short timeout: Ray's own connect retries for a minute or more."""
    if address == "auto":
        return  # ray.init(address="auto") fails fast when no local cluster is running
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} is not 'auto', 'host:port' or 'ray://host:port'")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as err:
        raise UserError(f"nothing answers at --address {address} ({err.strerror or err}); check "
                        "the address or start the cluster with `ray start --head`") from None


def local_resources(extra_cpus: int = 0) -> tuple[float, float]:
    """What a local instance started by `ray_session` will have: (CPUs, GPUs)."""
    import torch

    return float((os.cpu_count() or 1) + extra_cpus), float(torch.cuda.device_count())


def check_fits(cpus: float, gpus: float, what: str, have: tuple[float, float],
               waited: str = "") -> None:
    if have[0] >= cpus and have[1] >= gpus:
        return
    raise UserError(f"{what} needs {cpus:g} CPUs and {gpus:g} GPUs but the cluster has "
                    f"{have[0]:g} CPUs and {have[1]:g} GPUs{waited}; lower --workers / "
                    "--gpus-per-worker or add nodes")


def require_resources(cpus: float, gpus: float, what: str) -> None:
    """Wait (bounded) until the cluster could ever fit `cpus`/`gpus`, else one clear line."""
    import ray

    deadline = time.monotonic() + RESOURCE_WAIT_S
    while True:
        total = ray.cluster_resources()
        have = (total.get("CPU", 0.0), total.get("GPU", 0.0))
        if time.monotonic() > deadline:
            check_fits(cpus, gpus, what, have, f" (waited {RESOURCE_WAIT_S:g}s)")
        if have[0] >= cpus and have[1] >= gpus:
            return
        time.sleep(1.0)


def resolve_storage(storage: str | None, default: str) -> str:
    """An absolute local path, or a URI (s3://, gs://, ...) that pyarrow.fs understands."""
    storage = storage or default
    if "://" in storage:
        try:
            pyarrow.fs.FileSystem.from_uri(storage)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError for bad URIs
            raise UserError(f"--storage {storage}: {err}") from None
        return storage
    path = Path(storage).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise UserError(f"--storage {path} is a file; give a folder or a URI")
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def is_local(storage: str) -> bool:
    return "://" not in storage or storage.startswith("file://")
