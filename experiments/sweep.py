"""`gptrun sweep` / `gptrun resume`: the flow of a sweep, from the checks made before Ray starts
to the summary at the end. The Tuner is built in `experiments.tuner`, the trial function lives in
`experiments.trial`, the arithmetic in `experiments.sizing`, and the folder's files in
`experiments.experiment`. The noise check (`gptrun confirm`) is chained by the CLI, not here.

Nothing is deleted or written before every check has passed: the config, the folder, the study,
the cluster (its address, its size or what its autoscaler can add) and the storage.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from experiments import remote
from experiments.autoscale import room_for
from experiments.cluster import (
    check_fits,
    check_storage,
    create_storage,
    local_resources,
    verify_shared_storage,
    verify_trial_nodes,
)
from experiments.experiment import (
    BEST_FILE,
    STUDY_FILE,
    load_base,
    open_experiment,
    remove_experiment,
    save,
    saved_meta,
    start_experiment,
    study_url,
)
from experiments.outcome import best_trial
from experiments.ray_config import RayExperiment, checked_for_workers, load_experiment
from experiments.results import best_config, load_trials, load_tune_trials, print_table, print_trial_costs
from experiments.sizing import (
    concurrency,
    grace_tokens,
    local_extra_cpus,
    sweep_limit,
    trial_bundles,
    trial_footprint,
    trial_tokens,
)
from experiments.space import Space, parse_space
from experiments.study_db import shown_url
from experiments.tuner import new_tuner, restore_tuner, tracking_callbacks
from experiments.warm_start import History, load_history
from gptcore.errors import UserError


@dataclass
class SweepPlan:
    """A sweep checked before Ray starts: its config, search space and folder."""

    cfg: RayExperiment
    space: Space
    exp_dir: Path  # the experiment folder, or the local working copy of `uri`
    restart: bool = False
    uri: str | None = None  # the experiment in object storage
    replace_study: bool = False  # --restart may delete a study this folder did not create
    history: History | None = None  # a new sweep's warm start, loaded and checked

    @property
    def location(self) -> str:
        """Where Tune keeps the experiment: its URI or its folder."""
        return self.uri or str(self.exp_dir)

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
    replace_study: bool = False,
) -> SweepPlan:
    """Every check that needs no cluster: config, space, baseline, trackers, storage (a bucket
    that exists), folder, study, and the warm-start history (read now: a different space is
    refused before Ray starts). `address` is already resolved (`--address` or $RAY_ADDRESS)."""
    from experiments.study import check_new_study

    cfg = checked_for_workers(load_experiment(config, overrides))
    sweep_limit(cfg)  # a token budget that one report spends
    space = parse_space(cfg)
    if cfg.sweep.baseline:
        space.baseline(cfg)
    tracking_callbacks(cfg, "check")  # a missing tracking extra, before Ray starts
    storage = check_storage(storage, "sweeps")
    name = name or cfg.name
    if remote.is_uri(storage):
        uri = f"{storage.rstrip('/')}/{name}"
        exp_dir, exists = remote.working_copy(uri), remote.exists(uri)
    else:
        uri, exp_dir = None, Path(storage) / name
        exists = exp_dir.exists()
    if exists and not restart:
        shown = uri or exp_dir
        raise UserError(
            f"experiment {shown} exists; continue it with `gptrun resume {shown}` or start over "
            "with --restart"
        )
    history = load_history(cfg, space, exp_dir.parent)  # a URI's: the local working copies
    if cfg.sweep.storage_url:
        owner = saved_meta(exp_dir, uri) if exists else {}
        check_new_study(cfg.sweep.storage_url, name, restart=restart, replace=replace_study, owner=owner)
    if address is None:  # a local instance: no need to start Ray to know it is too small
        check_fits(*trial_footprint(cfg), "one trial", local_resources(local_extra_cpus(cfg)))
    return SweepPlan(cfg, space, exp_dir, restart, uri, replace_study, history)


def run_sweep(plan: SweepPlan) -> int:
    """Inside a Ray session: size the sweep to the cluster (or to what its autoscaler can add,
    asking for those nodes while it runs), run it, summarise it."""
    cfg, exp_dir = plan.cfg, plan.exp_dir
    cap = cfg.sweep.max_concurrent or cfg.sweep.num_samples
    with room_for(trial_bundles(cfg), cap, "one trial", lambda c, g: concurrency(cfg, c, g)) as width:
        parent = plan.location.rpartition("/")[0]
        create_storage(parent)
        verify_shared_storage(parent)  # every node must see the trials' checkpoints
        verify_trial_nodes(cfg.data.dir)  # every node that runs trials: our versions, the data
        if plan.restart:  # every check passed: the old experiment may go
            remove_experiment(exp_dir, plan.uri)
        else:
            claim_name(plan)
        if plan.restart and cfg.sweep.storage_url:
            from experiments.study import delete_study

            delete_study(cfg.sweep.storage_url, exp_dir.name)
        if plan.uri:
            remote.open_working_copy(plan.uri, pull=False)
        start_experiment(exp_dir, cfg, {"max_concurrent": width, **study_record(cfg, exp_dir)})
        print(
            f"sweep {plan.location}: {cfg.sweep.num_samples} trials, {width} at a time, "
            f"{trial_tokens(cfg):,} tokens each, ASHA grace {grace_tokens(cfg):,} tokens"
            f"{', budget ' + cfg.sweep.budget if cfg.sweep.budget else ''}; study "
            f"{shown_url(study_url(cfg, exp_dir))}",
            flush=True,
        )
        if plan.history:
            print(plan.history.note, flush=True)
        new_tuner(cfg, plan.space, exp_dir, width, budget=sweep_limit(cfg), history=plan.history).fit()
    return finish(cfg, plan.space, exp_dir)


def claim_name(plan: SweepPlan) -> None:
    """Take a new sweep's name, or refuse it if another sweep took it since `plan_sweep` looked
    (the wait for the cluster can last minutes; a teammate may start the same name meanwhile).
    A local folder is made with `mkdir`, which only one process can win; in object storage,
    which has no such call, a claim object is written and the name listed (`remote.claim`).
    A working copy left on this machine by a deleted URI is stale: it goes."""
    taken = f"experiment {plan.location} was created while this sweep waited for the cluster"
    if plan.uri:
        if not remote.claim(plan.uri):
            raise UserError(f"{taken}; pick another --name, or pass --restart to replace it")
        if plan.exp_dir.exists():
            shutil.rmtree(plan.exp_dir)
        return
    plan.exp_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        plan.exp_dir.mkdir()
    except FileExistsError:
        raise UserError(f"{taken}; pick another --name, or pass --restart to replace it") from None


def study_record(cfg: RayExperiment, exp_dir: Path) -> dict[str, str]:
    """What `sweep.json` says about the study this experiment created, so that --restart knows
    which study in a shared database is its own (the URL without its password)."""
    return {"study_url": shown_url(study_url(cfg, exp_dir)), "study_name": exp_dir.name}


def plan_resume(experiment: str) -> SweepPlan:
    """A sweep to resume: a folder or a URI (`gptrun sweep --storage s3://...` printed it)."""
    from ray import tune

    exp_dir = open_experiment(experiment)
    cfg, _ = load_base(exp_dir)
    uri = experiment.rstrip("/") if remote.is_uri(experiment) else None
    if not tune.Tuner.can_restore(uri or str(exp_dir)):
        raise UserError(
            f"{uri or exp_dir} has no Tune state to resume (killed before its first "
            "trial started?); start it again with `gptrun sweep CONFIG --restart`"
        )
    if uri and not cfg.sweep.storage_url and not (exp_dir / STUDY_FILE).exists():
        raise UserError(
            f"{uri}: its Optuna study is {STUDY_FILE} on the machine that started it (in gptrun's "
            "cache there), not in the object store; resume it on that machine, or give sweeps that "
            "move between machines a shared study with sweep.storage_url (PostgreSQL)"
        )
    return SweepPlan(checked_for_workers(cfg), parse_space(cfg), exp_dir, uri=uri)


def run_resume(plan: SweepPlan) -> int:
    print(f"resuming sweep {plan.location}", flush=True)
    cfg = plan.cfg
    cap = cfg.sweep.max_concurrent or cfg.sweep.num_samples
    with room_for(trial_bundles(cfg), cap, "one trial", None):  # Tune keeps the saved width
        verify_trial_nodes(cfg.data.dir)  # the cluster may not be the one the sweep began on
        restore_tuner(cfg, plan.space, plan.exp_dir).fit()
    return finish(cfg, plan.space, plan.exp_dir)


def finish(cfg: RayExperiment, space: Space, exp_dir: Path) -> int:
    """The summary table, the per-trial fixed costs, best.toml and the best checkpoint's path;
    the trials that the sweep's budget ended are recorded in the study first (Tune tells no
    searcher about them), so that the table and the study agree."""
    from experiments.study import close_unfinished

    cut = {t.trial_id: t.last_result for t in load_tune_trials(exp_dir) if t.status == "TERMINATED"}
    close_unfinished(study_url(cfg, exp_dir), exp_dir.name, cut)
    trials = load_trials(exp_dir)
    print_table(trials, space)
    print_trial_costs(trials)
    best = best_trial(trials)
    if best is None:
        if trials and all(t["status"] == "cut by budget" and not t["tokens"] for t in trials):
            # Only a wall-clock budget: a budget in tokens is counted from the trials' reports.
            print(
                f"sweep.budget={cfg.sweep.budget} ran out before any trial reported a validation "
                "loss (Ray's and the trials' start-up count towards it): give the sweep a larger budget"
            )
        else:
            print("no trial finished without error; see the reasons above")
        return 1
    save(exp_dir, BEST_FILE, best_config(cfg, space, best, exp_dir.name).to_toml())
    print(
        f"best trial {best['trial_id']}: val loss {best['val_loss']:.4f} | config "
        f"{exp_dir / BEST_FILE} | checkpoint {best['checkpoint']}"
    )
    print(f"train it at full length: gptrun train {exp_dir / BEST_FILE}")
    return 0
