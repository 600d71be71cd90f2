"""`gptrun plan`: what a sweep will cost before it runs — trials, concurrency, ASHA rungs, tokens,
wall-clock and CPU/GPU-hours — from a short measured throughput probe (or `--tokens-per-sec`)."""

from __future__ import annotations

import math
import os
import time

from experiments.ray_config import RayExperiment, load_experiment
from experiments.sizing import (
    asha_rungs,
    concurrency,
    expected_tokens,
    grace_tokens,
    is_lean,
    local_extra_cpus,
    sweep_limit,
    trial_footprint,
    trial_tokens,
)
from experiments.space import parse_space
from gptcore.durations import duration
from gptcore.errors import UserError

# Per-trial start-up measured on a 2-core machine: a 1-worker trial trains in its (reused) Tune
# process; a DDP trial starts a Ray Train worker group.
LEAN_STARTUP_S, DDP_STARTUP_S = 3.0, 30.0
PROBE_STEPS = 8


def probe_tokens_per_sec(cfg: RayExperiment) -> float:
    """Time a few real training steps of one worker in this process (after one warm-up step)."""
    import torch

    from gptcore.train import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    try:
        trainer = Trainer(cfg, log=None)
        trainer.train_step()
        trainer.synchronize()
        start = time.perf_counter()
        for _ in range(PROBE_STEPS):
            trainer.train_step()
        trainer.synchronize()  # a step returns once its work is queued on the device
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return PROBE_STEPS * trainer.tokens_per_step / elapsed


def plan_cli(
    config: str,
    overrides: list[str],
    *,
    tokens_per_sec: float | None,
    cpus: float | None,
    gpus: float | None,
    address: str | None = None,
) -> int:
    """`address` (already resolved: `--address` or $RAY_ADDRESS) sizes the plan to that cluster,
    or to the most its autoscaler can add; else `cpus` / `gpus`, else this machine."""
    cfg = load_experiment(config, overrides)
    limit = sweep_limit(cfg)
    space = parse_space(cfg)
    if cfg.sweep.baseline:
        space.baseline(cfg)  # the sweep would refuse a baseline outside its space: so does the plan
    if tokens_per_sec is not None and not tokens_per_sec > 0:
        raise UserError(f"--tokens-per-sec={tokens_per_sec:g} must be > 0 (a trial's throughput)")
    res = cfg.resources
    if address is not None and cpus is None and gpus is None:
        width, cluster = _cluster_width(cfg, address)
    else:
        if cpus is None:  # a local instance, as `gptrun sweep` starts it
            cpus = (os.cpu_count() or 1) + local_extra_cpus(cfg)
        if gpus is None:
            import torch

            gpus = float(torch.cuda.device_count())
        width, cluster = concurrency(cfg, cpus, gpus), f"cluster {cpus:g} CPU / {gpus:g} GPU"
        if width == 0:
            need_cpus, need_gpus = trial_footprint(cfg)
            raise UserError(
                f"one trial needs {need_cpus:g} CPUs and {need_gpus:g} GPUs but the "
                f"cluster has {cpus:g} CPUs and {gpus:g} GPUs"
            )
    if tokens_per_sec is None:
        tokens_per_sec = probe_tokens_per_sec(cfg) * res.workers
        source = f"measured: {PROBE_STEPS} steps here"
    else:
        source = "given"
    n, rf = cfg.sweep.num_samples, cfg.sweep.reduction_factor
    max_t = trial_tokens(cfg)
    rungs = asha_rungs(grace_tokens(cfg), max_t, rf)
    tokens = expected_tokens(n, rungs, rf)
    waves = math.ceil(n / width)
    startup = LEAN_STARTUP_S if is_lean(cfg) else DDP_STARTUP_S
    wall = tokens / (tokens_per_sec * width) + waves * startup
    full_wall = n * max_t / (tokens_per_sec * width) + waves * startup
    per_trial_gpus, per_trial_cpus = res.workers * res.gpus_per_worker, res.workers * res.cpus_per_worker
    print(f"plan for {config}")
    print(
        f"  search       {', '.join(p.key for p in space.params)}"
        f"{' (+ baseline trial)' if cfg.sweep.baseline else ''}"
    )
    print(
        f"  trials       {n}, {width} at a time ({per_trial_cpus:g} CPU / {per_trial_gpus:g} GPU"
        f" each; {cluster})"
    )
    print(f"  per trial    {max_t:,} tokens, {tokens_per_sec:,.0f} tokens/s ({source})")
    print(f"  ASHA rungs   {', '.join(f'{r:,}' for r in rungs)} tokens (reduction factor {rf})")
    print(f"  tokens       ~{tokens:,.0f} with ASHA, {n * max_t:,} without")
    print(
        f"  wall-clock   ~{duration(wall)} with ASHA (~{duration(full_wall)} without), including "
        f"{startup:.0f}s start-up per trial"
    )
    used = wall * width / 3600
    print(f"  cost         ~{used * per_trial_gpus:.2f} GPU-hours, ~{used * per_trial_cpus:.2f} CPU-hours")
    if limit:  # a budget in tokens counts what the trials train; ASHA's expected tokens are the need
        need, share = (
            (f"~{tokens:,.0f} tokens", tokens / limit.amount)
            if limit.tokens
            else (f"~{duration(wall)}", wall / limit.amount)
        )
        worth = f" ({limit.amount / max_t:.1f} full trials' worth)" if limit.tokens else ""
        if share > 1:
            print(
                f"warning: the plan needs {need} but sweep.budget is {cfg.sweep.budget}{worth}; trials "
                "will be cut off. Lower sweep.num_samples or train.max_tokens, or raise the budget"
            )
        else:
            print(f"  budget       {cfg.sweep.budget}{worth}: fits ({100 * share:.0f}% of it)")
    return 0


def _cluster_width(cfg: RayExperiment, address: str) -> tuple[int, str]:
    """Trials at once on the cluster at `address` and how it was sized: its nodes now (a
    static cluster, one line when one trial does not fit), or the most its autoscaler can add."""
    from experiments.autoscale import autoscaler_growth, plan_width
    from experiments.cluster import check_fits, cluster_size, ray_session
    from experiments.sizing import trial_bundles

    with ray_session(address):
        growth = autoscaler_growth()
        now = cluster_size()
        if growth is None:
            check_fits(*trial_footprint(cfg), "one trial", now)
            return concurrency(cfg, *now), f"cluster {now[0]:g} CPU / {now[1]:g} GPU"
        cap = cfg.sweep.max_concurrent or cfg.sweep.num_samples
        if not growth.known:
            return cap, f"autoscaling cluster of unknown size, {now[0]:g} CPU / {now[1]:g} GPU now"
        width, _ = plan_width(growth, trial_bundles(cfg), cap, "one trial")
        return width, f"autoscaling cluster: {now[0]:g} CPU / {now[1]:g} GPU now, {growth.describe()}"
