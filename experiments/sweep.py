"""`gptrun sweep` / `gptrun resume`: the flow of a sweep, from the checks made before Ray starts
to the summary at the end. The Tuner is built in `experiments.tuner`, the trial function lives in
`experiments.trial`, the arithmetic in `experiments.budget`, and the folder's files in
`experiments.experiment`. The noise check (`gptrun confirm`) is chained by the CLI, not here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from experiments.budget import (
    concurrency,
    grace_tokens,
    local_extra_cpus,
    trial_footprint,
    trial_tokens,
)
from experiments.cluster import (
    check_fits,
    check_storage,
    create_storage,
    local_resources,
    require_resources,
    verify_shared_storage,
)
from experiments.config import RayExperiment, checked_for_workers, load_experiment
from experiments.experiment import (
    BEST_FILE,
    load_base,
    start_experiment,
    study_url,
)
from experiments.results import best_config, load_trials, print_table, print_trial_costs
from experiments.space import Space, parse_space
from experiments.storage import shown_url
from experiments.tuner import new_tuner, restore_tuner, tracking_callbacks
from experiments.warm_start import History, load_history
from gptcore.atomic import write_text_atomic
from gptcore.errors import UserError


@dataclass
class SweepPlan:
    """A sweep checked before Ray starts: its config, search space and folder."""

    cfg: RayExperiment
    space: Space
    exp_dir: Path
    restart: bool = False
    history: History | None = None  # a new sweep's warm start, loaded and checked

    @property
    def extra_local_cpus(self) -> int:
        return local_extra_cpus(self.cfg)


def plan_sweep(
    config: str,
    overrides: list[str],
    *,
    name: str | None,
    storage: str | None,
    restart: bool,
    address: str | None,
) -> SweepPlan:
    """Every check that needs no cluster: config, space, baseline, trackers, folder, study, and
    the warm-start history (read now: a different space is refused before Ray starts)."""
    from experiments.study import check_new_study

    cfg = checked_for_workers(load_experiment(config, overrides))
    space = parse_space(cfg)
    if cfg.sweep.baseline:
        space.baseline(cfg)
    tracking_callbacks(cfg, "check")  # a missing tracking extra, before Ray starts
    storage = check_storage(storage, "sweeps")
    if "://" in storage:
        raise UserError(
            "gptrun sweep keeps its experiment folder on a path (NFS on a cluster); "
            "object-store URIs are supported by `gptrun train --storage`"
        )
    exp_dir = Path(storage) / (name or cfg.name)
    if exp_dir.exists() and not restart:
        raise UserError(
            f"experiment {exp_dir} exists; continue it with `gptrun resume "
            f"{exp_dir}` or start over with --restart"
        )
    history = load_history(cfg, space, Path(storage))
    if cfg.sweep.storage_url:
        check_new_study(cfg.sweep.storage_url, exp_dir.name, replace=restart)
    if address is None:  # a local instance: no need to start Ray to know it is too small
        check_fits(*trial_footprint(cfg), "one trial", local_resources(local_extra_cpus(cfg)))
    return SweepPlan(cfg, space, exp_dir, restart, history)


def run_sweep(plan: SweepPlan) -> int:
    """Inside a Ray session: size the sweep to the cluster, run it, summarise it."""
    cfg, exp_dir = plan.cfg, plan.exp_dir
    require_resources(*trial_footprint(cfg), "one trial")
    width = concurrency(cfg, *_cluster_size())
    create_storage(str(exp_dir.parent))
    verify_shared_storage(str(exp_dir.parent))  # every node must see the trials' checkpoints
    if plan.restart and exp_dir.exists():
        shutil.rmtree(exp_dir)
    start_experiment(exp_dir, cfg, {"max_concurrent": width})
    print(
        f"sweep {exp_dir}: {cfg.sweep.num_samples} trials, {width} at a time, "
        f"{trial_tokens(cfg):,} tokens each, ASHA grace {grace_tokens(cfg):,} tokens"
        f"{', budget ' + cfg.sweep.budget if cfg.sweep.budget else ''}; study "
        f"{shown_url(study_url(cfg, exp_dir))}",
        flush=True,
    )
    if plan.history:
        print(plan.history.note, flush=True)
    new_tuner(cfg, plan.space, exp_dir, width, history=plan.history).fit()
    return finish(cfg, plan.space, exp_dir)


def plan_resume(experiment_dir: str) -> SweepPlan:
    from ray import tune

    exp_dir = Path(experiment_dir).expanduser().resolve()
    cfg, _ = load_base(exp_dir)
    if not tune.Tuner.can_restore(str(exp_dir)):
        raise UserError(
            f"{exp_dir} has no Tune state to resume (killed before its first "
            "trial started?); start it again with `gptrun sweep CONFIG --restart`"
        )
    return SweepPlan(checked_for_workers(cfg), parse_space(cfg), exp_dir)


def run_resume(plan: SweepPlan) -> int:
    print(f"resuming sweep {plan.exp_dir}", flush=True)
    restore_tuner(plan.cfg, plan.space, plan.exp_dir).fit()
    return finish(plan.cfg, plan.space, plan.exp_dir)


def finish(cfg: RayExperiment, space: Space, exp_dir: Path) -> int:
    """The summary table, the per-trial fixed costs, best.toml and the best checkpoint's path;
    trials that the budget ended or a killed driver left RUNNING in the study are closed."""
    from experiments.study import close_running

    trials = load_trials(exp_dir)
    cut = {t["trial_id"] for t in trials if t["status"] == "cut by budget"}
    close_running(study_url(cfg, exp_dir), exp_dir.name, {t["trial_id"] for t in trials}, cut)
    print_table(trials, space)
    print_trial_costs(trials)
    ok = [t for t in trials if t["status"] in ("completed", "stopped early", "cut by budget")]
    if not ok:
        print("no trial finished without error; see the reasons above")
        return 1
    best = min(ok, key=lambda t: t["val_loss"])
    write_text_atomic(exp_dir / BEST_FILE, best_config(cfg, space, best, exp_dir.name).to_toml())
    print(
        f"best trial {best['trial_id']}: val loss {best['val_loss']:.4f} | config "
        f"{exp_dir / BEST_FILE} | checkpoint {best['checkpoint']}"
    )
    print(f"train it at full length: gptrun train {exp_dir / BEST_FILE}")
    return 0


def _cluster_size() -> tuple[float, float]:
    import ray

    total = ray.cluster_resources()
    return total.get("CPU", 0.0), total.get("GPU", 0.0)
