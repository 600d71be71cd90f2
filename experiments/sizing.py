"""Sweep arithmetic, in one place for `gptrun sweep`, `gptrun plan` and the results reader: a
trial's tokens, ASHA's grace and rungs, what one trial reserves, and how many fit at once."""

from __future__ import annotations

from experiments.ray_config import RayExperiment, SweepLimit, parse_budget
from gptcore.config import run_length
from gptcore.errors import UserError

# A DDP trial's Tune process only waits on its TorchTrainer, whose workers reserve the CPUs/GPUs.
DDP_DRIVER_CPU = 0.01


def trial_tokens(cfg: RayExperiment) -> int:
    """A trial's length in tokens (ASHA's max_t)."""
    return run_length(cfg, cfg.resources.workers).total_tokens


def first_report_tokens(cfg: RayExperiment) -> int:
    """The tokens a trial has trained at its first report (its first evaluation)."""
    length = run_length(cfg, cfg.resources.workers)
    return length.tokens_per_step * min(cfg.train.eval_interval, length.total_steps)


def sweep_limit(cfg: RayExperiment) -> SweepLimit | None:
    """`sweep.budget` read, if set. A token budget that one trial's first report already spends
    would end the sweep before any trial could be compared: a slip of the unit, refused."""
    if not cfg.sweep.budget:
        return None
    limit = parse_budget(cfg.sweep.budget)
    first = first_report_tokens(cfg)
    if limit.tokens and limit.amount <= first:
        raise UserError(
            f"sweep.budget={cfg.sweep.budget!r} is spent by one trial's first report ({first:,} "
            f"tokens, at train.eval_interval); give the sweep a few trials' worth "
            f"({trial_tokens(cfg):,} tokens each)"
        )
    return limit


def grace_tokens(cfg: RayExperiment) -> int:
    """Tokens before ASHA's first cut: `sweep.grace_tokens`, or a quarter of the trial."""
    return min(cfg.sweep.grace_tokens or max(1, trial_tokens(cfg) // 4), trial_tokens(cfg))


def is_lean(cfg: RayExperiment) -> bool:
    """A 1-worker trial trains inside its Tune trial process: no TorchTrainer, no worker group."""
    return cfg.resources.workers == 1


def trial_resources(cfg: RayExperiment) -> dict[str, float]:
    """What Tune reserves for the trial process itself (the Tune resource names)."""
    res = cfg.resources
    if is_lean(cfg):
        return {"cpu": res.cpus_per_worker, "gpu": res.gpus_per_worker}
    return {"cpu": DDP_DRIVER_CPU}


def trial_footprint(cfg: RayExperiment) -> tuple[float, float]:
    """(CPUs, GPUs) one trial holds while it runs, its workers included."""
    res = cfg.resources
    cpus = res.workers * res.cpus_per_worker + (0.0 if is_lean(cfg) else DDP_DRIVER_CPU)
    return cpus, res.workers * res.gpus_per_worker


def trial_bundles(cfg: RayExperiment) -> list[dict[str, float]]:
    """The resource bundles one trial holds, as Ray spells them (what an autoscaler is asked
    for): one per worker, and a DDP trial's own Tune process."""
    res = cfg.resources
    worker = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus_per_worker} if res.gpus_per_worker else {})}
    process = [] if is_lean(cfg) else [{"CPU": DDP_DRIVER_CPU}]
    return [dict(worker) for _ in range(res.workers)] + process


def local_extra_cpus(cfg: RayExperiment) -> int:
    """Logical CPUs a local Ray instance adds for DDP trials' Tune processes (0.01 CPU each), so
    that N cores still run N one-CPU workers; a 1-worker trial's process is its worker."""
    return 0 if is_lean(cfg) else 1


def concurrency(cfg: RayExperiment, cpus: float, gpus: float) -> int:
    """How many trials fit at once: GPUs // GPUs per trial, or CPUs on a CPU cluster; capped by
    `sweep.max_concurrent`."""
    need_cpus, need_gpus = trial_footprint(cfg)
    fit = int(gpus // need_gpus) if need_gpus > 0 else int(cpus // need_cpus)
    if cfg.sweep.max_concurrent:
        fit = min(fit, cfg.sweep.max_concurrent)
    return max(fit, 0)


def startup_trials(num_samples: int) -> int:
    """TPE's random start-up: a quarter of the sweep, at least 3 and at most Optuna's default 10.
    The default 10 is more than a short sweep's whole length, which would leave TPE nothing to
    do; the baseline point counts as one of them."""
    return min(10, max(3, num_samples // 4))


def asha_rungs(grace: int, max_t: int, reduction_factor: int) -> list[int]:
    """The token counts at which ASHA compares trials, ending with a full trial."""
    rungs, milestone = [], grace
    while milestone < max_t:
        rungs.append(milestone)
        milestone *= reduction_factor
    return [*rungs, max_t]


def expected_tokens(num_samples: int, rungs: list[int], reduction_factor: int) -> float:
    """Tokens trained if ASHA promotes 1/reduction_factor of the trials at every rung."""
    total, previous = 0.0, 0
    for k, milestone in enumerate(rungs):
        total += num_samples / reduction_factor**k * (milestone - previous)
        previous = milestone
    return total
