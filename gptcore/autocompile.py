"""`train.compile`: torch.compile where it pays for itself, with an on-disk cache that runs share.

Compiling costs seconds to minutes before the first step, then makes every forward + backward
faster, so whether it pays depends on how long the run is. `auto` (the default) times the eager
model step (forward + backward) on a real batch and compiles when the time it expects to save
over the steps left exceeds the compile time it expects:

    saving = steps left x micro-steps per step x eager model step x (1 - 1 / speedup)

Every compile measures what it cost and a few timed model steps each way, cached per (device,
torch version, model shape, batch, precision) in gptrun's cache folder (`compile_costs.json`) as
durations under the rule of every cached measurement (`gptcore.measured.Measured`): the shortest
sample of each is kept, since other work on the machine only lengthens a timing. The speedup
expected is the best eager step over the best compiled step, so one step timed on a busy machine
(seen off several-fold either way) moves nothing; a warm inductor cache compiles several times
faster than a cold one, and its compile is the cost from then on, which every later run on the
node pays too. Until a shape has been compiled once on a machine, `PRIORS` stand in.

Inductor's and AOTAutograd's on-disk caches go to gptrun's cache folder too (`torch-compile/`,
unless TORCHINDUCTOR_CACHE_DIR is set), so the later trials of a sweep on one node, and a
resumed run, compile from a warm cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptcore.config import SHAPE_KEYS, ExperimentConfig
from gptcore.data import cache_dir
from gptcore.durations import duration
from gptcore.measured import Measured
from gptcore.mfu import machine_name
from gptcore.private_torch import inductor_default_cache_dir

COSTS = Measured("compile_costs.json", best=min)  # seconds: durations, so the shortest sample


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
    figures = COSTS.read()
    seconds, eager, compiled = (figures.get(f"{key}|{name}") for name in _FIGURES)
    cost = PRIORS.get(device.type)
    if seconds and eager and compiled:
        cost = CompileCost(seconds, eager / compiled, "measured")
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


_FIGURES = ("compile", "eager_step", "compiled_step")  # seconds, each `key|name` in `COSTS`


def record(
    key: str, seconds: float | None, eager_steps: Sequence[float], compiled_steps: Sequence[float]
) -> None:
    """Keep one compile's samples: its `seconds` (None: not a compile a new run would pay) and
    its timed model steps each way."""
    taken = ([] if seconds is None else [seconds], eager_steps, compiled_steps)
    for name, samples in zip(_FIGURES, taken, strict=True):
        COSTS.add(f"{key}|{name}", *samples)


def share_compile_cache() -> None:
    """Point inductor's (and so AOTAutograd's) on-disk caches into gptrun's cache folder, unless
    the user chose a folder. Importing torch._dynamo (any optimizer does) already sets the
    variable to inductor's default, a per-user folder in /tmp; that one is replaced. Inductor
    reads the variable at each compile."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(inductor_default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torch-compile")
