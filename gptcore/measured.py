"""Measurements of this machine (matmul peaks, compile costs), cached on disk as JSON tables.

A measurement is slow or noisy to repeat, and it holds for every run on the node with the same
hardware and torch, so each table lives in gptrun's cache folder (`gptcore.data.cache_dir`). A
table is read and rewritten under an exclusive lock on a file beside it: trials starting together
on a fresh node take turns, so one measures while the others wait and then read its figure.

Every figure kept follows one rule (`Measured`): it is the best of several samples, it is checked
against what else is known before it is used, and it is measured again when that contradicts it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from gptcore.atomic import atomic_file
from gptcore.data import cache_dir
from gptcore.errors import UserError


@dataclass(frozen=True)
class Measured:
    """A kind of figure of this machine, kept in the table `table` by key: the best sample yet.

    Other work on a shared machine only ever slows a measurement down: a rate comes out too low, a
    duration too long, never the other way. So the best sample (`best`: max for a rate, min for a
    duration) is the least disturbed one; a figure is first taken from `samples` samples `gap_s`
    apart (a burst of load lowers one, rarely all; none is begun after `budget_s`, so that a slow
    measurement is taken once), and a later sample replaces it only where it is better. A figure
    can still be wrong (every sample taken in one long busy spell), and on disk it would stay
    wrong for every later run: so a reading states what the figure must satisfy (`plausible`: not
    below what fewer threads reached, not below a rate a run reached), and a cached figure that
    fails is measured again. What still fails then is the caller's to flag."""

    table: str
    best: Callable[[Iterable[float]], float]
    samples: int = 3
    gap_s: float = 0.2
    budget_s: float = 5.0

    def read(self) -> dict[str, float]:
        """Every usable figure of the table (a damaged entry reads as never measured)."""
        with locked_table(self.table) as table:
            return {key: float(value) for key, value in table.items() if _usable(value)}

    def figure(
        self, key: str, sample: Callable[[], float], plausible: Callable[[float], bool] = lambda _f: True
    ) -> float | None:
        """The figure of `key`: the cached one where it is `plausible`, else the best of it and
        `samples` new samples of `sample()` (kept). None where no sample was usable."""
        with locked_table(self.table) as table:
            old = table.get(key)
            if _usable(old) and plausible(float(old)):
                return float(old)
            new, start = [], time.monotonic()
            while len(new) < self.samples and (not new or time.monotonic() - start < self.budget_s):
                if new:
                    time.sleep(self.gap_s)
                new.append(sample())
            return self._keep(table, key, [old, *new])

    def add(self, key: str, *samples: float) -> float | None:
        """Keep samples taken elsewhere (a compile's timings); returns the figure now in force."""
        with locked_table(self.table) as table:
            return self._keep(table, key, [table.get(key), *samples])

    def _keep(self, table: dict, key: str, samples: list) -> float | None:
        usable = [float(s) for s in samples if _usable(s)]
        if not usable:
            return None
        table[key] = self.best(usable)
        return table[key]


def _usable(value: object) -> bool:
    """A measured figure is a positive finite number: a rate or a duration."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf  # NaN: no


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


def _lock(path: Path) -> contextlib.AbstractContextManager:
    """An exclusive lock on a file beside `path` (filelock: released when the block ends or the
    process dies); none where the folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    if not os.access(path.parent, os.W_OK):
        return contextlib.nullcontext()
    return FileLock(path.with_name(path.name + ".lock"))
