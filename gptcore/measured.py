"""Measurements of this machine (matmul peaks, compile costs), cached on disk as JSON tables.

A measurement is slow or noisy to repeat, and it holds for every run on the node with the same
hardware and torch, so each table lives in gptrun's cache folder (`gptcore.data.cache_dir`). A
table is read and rewritten under an exclusive lock on a file beside it: trials starting together
on a fresh node take turns, so one measures while the others wait and then read its figure.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path

from gptcore.atomic import atomic_file
from gptcore.data import cache_dir
from gptcore.errors import UserError


def table_path(name: str) -> Path:
    return cache_dir() / name


@contextlib.contextmanager
def locked_table(name: str) -> Iterator[dict]:
    """The table `name` as a dict, held under its lock; what the block changes is written back
    (atomically). Where the cache folder cannot be written there is no lock and nothing is kept:
    that costs a measurement next time, never the run."""
    path = table_path(name)
    with _lock(path):
        table = _read(path)
        before = json.dumps(table, indent=1, sort_keys=True)
        yield table
        after = json.dumps(table, indent=1, sort_keys=True)
        if after != before:
            try:
                with atomic_file(path) as tmp:
                    tmp.write_text(after)
            except (OSError, UserError):  # UserError: a folder that cannot be written
                pass


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        yield
