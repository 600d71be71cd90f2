"""`train.compile`: torch.compile where it pays for itself, with an on-disk cache that runs share.

Compiling costs seconds to minutes before the first step, then makes every forward + backward
faster, so whether it pays depends on how long the run is. `auto` (the default) times the eager
model step (forward + backward) on a real batch and compiles when the time it expects to save
over the steps left exceeds the compile time it expects:

    saving = steps left x micro-steps per step x eager model step x (1 - 1 / speedup)

Every compile measures its cost and speedup (medians of a few timed steps each way), and they
are cached per (device, torch version, model shape, batch, precision) in gptrun's cache folder
(`compile_costs.json`). The cost is rewritten when a compile lands far from it (a warm inductor
cache compiles several times faster than a cold one); the speedup expected is the median of the
last `KEPT_SPEEDUPS` measured, since one timing on a busy machine can be off several-fold either
way. Until a shape has been compiled once on a machine, `PRIORS` stand in.

Inductor's and AOTAutograd's on-disk caches go to gptrun's cache folder too (`torch-compile/`,
unless TORCHINDUCTOR_CACHE_DIR is set), so the later trials of a sweep on one node, and a
resumed run, compile from a warm cache.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

from gptcore.config import SHAPE_KEYS, ExperimentConfig
from gptcore.data import cache_dir
from gptcore.measured import locked_table
from gptcore.mfu import machine_name

COSTS_FILE = "compile_costs.json"
REFRESH_RATIO = 1.5  # a compile this many times off the cached seconds (either way) is cached anew
KEPT_SPEEDUPS = 5  # the speedup expected is the median of this many last measured


@dataclass(frozen=True)
class CompileCost:
    seconds: float  # from torch.compile to the end of the first compiled forward + backward
    speedup: float  # eager model step time / compiled model step time
    source: str  # "measured", "a guess", or none (this process compiled the shape already)


_compiled_here: set[str] = set()  # the keys this process has compiled


# Before a shape was compiled on a machine: a cold compile of a 4-layer / d_model 256 model on a
# 2-core CPU took 28 s for a 1.2x faster step (issue 26); GPUs take longer to compile, gain more.
PRIORS = {"cpu": CompileCost(30.0, 1.2, "a guess"), "cuda": CompileCost(60.0, 1.3, "a guess")}


def cost_key(device: torch.device, cfg: ExperimentConfig, precision: str) -> str:
    """What a compile measurement holds for: the machine, torch, the model and batch shape."""
    shape = ",".join(f"{k}={getattr(cfg.model, k)}" for k in (*SHAPE_KEYS, "seq_len"))
    return (
        f"{machine_name(device)}|torch={torch.__version__}|{shape}|batch={cfg.train.batch_size}"
        f"|lora={cfg.lora.rank}|{precision}"
    )


def expected_cost(key: str, device: torch.device) -> CompileCost | None:
    """The cached measurement of `key`, else the prior of the device type (None: no compile);
    free where this process compiled `key` before (`first_compile_here`)."""
    with locked_table(COSTS_FILE) as table:
        cost = _cached(table, key) or PRIORS.get(device.type)
    if cost is not None and key in _compiled_here:
        return CompileCost(0.0, cost.speedup, "none: compiled in this process before")
    return cost


def decide(micro_steps_left: int, model_step_seconds: float, cost: CompileCost | None) -> tuple[bool, str]:
    """auto's choice and the log line that says why."""
    if cost is None:
        return False, "compile off (auto: torch.compile is chosen on cpu and cuda only)"
    saving = micro_steps_left * model_step_seconds * (1 - 1 / cost.speedup)
    on = saving > cost.seconds
    return on, (
        f"compile {'on' if on else 'off'} (auto): ~{duration(cost.seconds)} to save "
        f"~{duration(max(saving, 0.0))} ({model_step_seconds * 1e3:.0f} ms eager model step x "
        f"{micro_steps_left:,} left, {cost.speedup:.2f}x faster compiled; compile cost {cost.source})"
    )


def first_compile_here(key: str) -> bool:
    """Whether this process compiles `key` for the first time (and note that it has). A later
    compile of the same shape in one process (the next trial in a reused Tune process) is served by
    dynamo's and inductor's in-memory caches in well under a second, which a new run never gets."""
    first = key not in _compiled_here
    _compiled_here.add(key)
    return first


def record(key: str, measured: CompileCost, *, with_seconds: bool = True) -> None:
    """Add `measured` to the cache: its seconds (if `with_seconds`) unless the cached figure is
    within `REFRESH_RATIO` of them, its speedup to the last `KEPT_SPEEDUPS`."""
    with locked_table(COSTS_FILE) as table:
        old = _cached(table, key)
        seconds = measured.seconds
        if old is not None and not with_seconds:
            seconds = old.seconds
        if old is not None and old.seconds / REFRESH_RATIO <= seconds <= old.seconds * REFRESH_RATIO:
            seconds = old.seconds
        speedups = table[key]["speedups"] if old is not None else []
        table[key] = {
            "seconds": float(f"{seconds:.4g}"),
            "speedups": [*speedups, round(measured.speedup, 4)][-KEPT_SPEEDUPS:],
        }


def _cached(table: dict, key: str) -> CompileCost | None:
    entry = table.get(key)
    if not isinstance(entry, dict):
        return None
    seconds, speedups = entry.get("seconds"), entry.get("speedups")
    if not (isinstance(seconds, (int, float)) and seconds >= 0 and isinstance(speedups, list) and speedups):
        return None
    if not all(isinstance(s, (int, float)) and s > 0 for s in speedups):
        return None
    return CompileCost(float(seconds), float(statistics.median(speedups)), "measured")


def share_compile_cache() -> None:
    """Point inductor's (and so AOTAutograd's) on-disk caches into gptrun's cache folder, unless
    the user chose a folder. Importing torch._dynamo (any optimizer does) already sets the
    variable to inductor's default, a per-user folder in /tmp; that one is replaced. Inductor
    reads the variable at each compile."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torch-compile")


def duration(seconds: float) -> str:
    """28 s, 6.0 min, 1.5 h: the scale a compile decision is read at."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
