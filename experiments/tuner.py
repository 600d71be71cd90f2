"""The Ray Tune side of a sweep: the Tuner (new or restored), its search (TPE + ASHA on tokens,
the Optuna study in its storage), and the trackers. `gptrun sweep`, `gptrun resume`,
`gptrun confirm` and the benchmarks all build their Tuner here."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from experiments import remote
from experiments.experiment import RUNS_DIR, study_url, trial_dirname
from experiments.objective import METRIC, MODE
from experiments.ray_config import RayExperiment, SweepConfig, SweepLimit
from experiments.ray_train import diverged_loss
from experiments.record import read_records, replay_result
from experiments.sizing import grace_tokens, is_lean, startup_trials, trial_resources, trial_tokens
from experiments.space import Space
from experiments.trial import run_trial
from experiments.warm_start import History, start_study
from gptcore.errors import UserError

REPORT_COLUMNS = ["tokens", "loss", "val_loss", "val_bpb", "tokens_per_sec"]


def new_tuner(
    cfg: RayExperiment,
    space: Any,
    exp_dir: Path,
    width: int,
    *,
    tune_config: Any = None,
    param_space: dict | None = None,
    budget: SweepLimit | None = None,
    tracking_name: str = "",
    history: History | None = None,
) -> Any:
    """The Tuner of experiment `exp_dir`: one `run_trial` per trial, `space.overrides(config)`
    turning a trial's config into config values. The search defaults to TPE + ASHA from
    `cfg.sweep` (`search_config`, its study starting with the warm-start `history`); `gptrun
    confirm` and the benchmarks pass their own. `budget` ends the whole experiment
    (`SweepBudget`): the sweep's is `sweep_limit(cfg)`, a confirm has none. Trackers log under
    `tracking_name` (default: the experiment's name)."""
    from ray import tune

    from experiments.events import SweepBudget, TrialEvents
    from experiments.newest_checkpoint import NewestCheckpoints

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's table reporter, not the new UI
    # Frequent checkpoints of short trials trigger a warning about snapshot frequency that a
    # user cannot act on: the snapshots are what makes a killed sweep resumable.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    snapshot_often()
    tune_config = tune_config or search_config(cfg, space, exp_dir, history)
    tune_config.max_concurrent_trials = width
    tune_config.trial_dirname_creator = trial_dirname
    tune_config.reuse_actors = is_lean(cfg)  # a warm process: torch imported, threads set up
    reporter = tune.CLIReporter(
        metric_columns=REPORT_COLUMNS,
        max_report_frequency=30,
        parameter_columns=list(space.keys),
        metric=METRIC,
        mode=MODE,  # not sort_by_metric: it crashes on a trial ended before its first report
    )
    callbacks = [
        TrialEvents(exp_dir, trial_tokens(cfg)),
        NewestCheckpoints(exp_dir, study_url(cfg, exp_dir)),  # each trial from its newest checkpoint
        *tracking_callbacks(cfg, tracking_name or exp_dir.name, exp_dir),
    ]
    storage_path, _, name = remote.location(exp_dir).rpartition("/")
    return tune.Tuner(
        trainable(cfg, space, exp_dir),
        param_space=param_space,
        tune_config=tune_config,
        run_config=tune.RunConfig(
            name=name,
            storage_path=storage_path,
            progress_reporter=reporter,
            verbose=1,
            stop=SweepBudget(exp_dir, budget) if budget else None,
            callbacks=callbacks,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints or None),
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )


def restore_tuner(cfg: RayExperiment, space: Any, exp_dir: Path) -> Any:
    """The Tuner of an interrupted experiment: its trials, searcher, scheduler and callbacks come
    back from Tune's state, reconciled to the study (`experiments.record`): a trial the study saw
    end is ended again with its recorded result, without training; unfinished trials continue
    from their newest checkpoint (`NewestCheckpoints`)."""
    from ray import tune

    snapshot_often()
    records = read_records(study_url(cfg, exp_dir), exp_dir.name)
    ended = {tid: replay_result(r, diverged_loss(cfg)) for tid, r in records.items() if r.ended}
    return tune.Tuner.restore(
        remote.location(exp_dir), trainable=trainable(cfg, space, exp_dir, ended), resume_errored=True
    )


def snapshot_often() -> None:
    """Tune snapshots its experiment state every `TUNE_GLOBAL_CHECKPOINT_S` seconds (by default
    at least 10 s apart). A trial asked after the last snapshot is run by a resume under a new
    Tune trial (its sampled values and checkpoints kept, `StudySearch.restore`), and the work
    since its last checkpoint is lost: every second keeps such trials rare, for what
    docs/sweeps.md measures as a cost within noise."""
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def trainable(cfg: RayExperiment, space: Any, exp_dir: Path, ended: dict[str, dict] | None = None) -> Any:
    """`run_trial` with the experiment's config bound and the trial's resources reserved;
    `ended`: the replayed ends of a resume."""
    from ray import tune

    base = {"config": cfg.to_dict(), "space": space}
    runs = f"{remote.location(exp_dir)}/{RUNS_DIR}"
    return tune.with_resources(
        tune.with_parameters(run_trial, base=base, runs_storage=runs, ended=ended or {}), trial_resources(cfg)
    )


def search_config(cfg: RayExperiment, space: Space, exp_dir: Path, history: History | None = None) -> Any:
    """TPE (`tpe_sampler`; the baseline as its first point) writing its study to `study_url`,
    which starts with the warm-start `history` if any, and ASHA on tokens."""
    from ray import tune

    from experiments.events import RecordingASHA
    from experiments.study import StudySearch
    from experiments.study_db import rdb_storage

    points = [space.baseline(cfg)] if cfg.sweep.baseline else None
    max_t = trial_tokens(cfg)
    url = study_url(cfg, exp_dir)
    start_study(url, exp_dir.name, space, max_t, history)
    searcher = StudySearch(
        full_tokens=max_t,
        num_samples=cfg.sweep.num_samples,
        space=space.suggest,
        points_to_evaluate=points,
        sampler=tpe_sampler(cfg.sweep, space),
        study_name=exp_dir.name,
        metric=METRIC,
        mode=MODE,
        storage=rdb_storage(url),
    )
    scheduler = RecordingASHA(
        exp_dir,
        time_attr="tokens",
        max_t=max_t,
        grace_period=grace_tokens(cfg),
        reduction_factor=cfg.sweep.reduction_factor,
        metric=METRIC,
        mode=MODE,
    )
    return tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=cfg.sweep.num_samples)


def tpe_sampler(sweep: SweepConfig, space: Space) -> Any:
    """Optuna's TPE as `[sweep]` sets it, seeded, with a random start-up scaled to the sweep
    (`startup_trials`; warm-start history counts towards it). By default it is built for trials
    that run at once: `multivariate` models the parameters jointly, `constant_liar` counts the
    trials still running as bad results so that K trials asked together spread out instead of
    piling onto the same best guess, and `group` (with multivariate, for a space with
    include_zero) models the keys that every trial has jointly and the conditional ones apart.
    Optuna's defaults moved between versions (4.x: independent, no liar; 5.x: both on), so every
    choice is passed explicitly."""
    import optuna

    with warnings.catch_warnings():
        # Optuna marks `group` experimental (since 2.8); it is our documented [sweep] option.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=sweep.seed,
            n_startup_trials=startup_trials(sweep.num_samples),
            multivariate=sweep.multivariate,
            constant_liar=sweep.constant_liar,
            group=sweep.multivariate and sweep.group and space.conditional,
        )


def tracking_callbacks(cfg: RayExperiment, experiment: str, folder: Path | None = None) -> list[Any]:
    """MLflow / W&B loggers from `[tracking]`, empty unless the user set them (no network call
    otherwise). They run in the Tune driver on each trial's results, which are rank 0's reports;
    each trial is one MLflow run / W&B run in the experiment's name / group. W&B's run folders go
    to `folder/wandb/` (the experiment folder), where `wandb sync` finds runs made offline."""
    callbacks: list[Any] = []
    if cfg.tracking.mlflow_uri:
        _require_extra("mlflow", "mlflow")
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no calls home

        callbacks.append(
            MLflowLoggerCallback(
                tracking_uri=cfg.tracking.mlflow_uri, experiment_name=experiment, save_artifact=False
            )
        )
    if cfg.tracking.wandb_project:
        _require_extra("wandb", "wandb")
        _require_wandb_login()
        from ray.air.integrations.wandb import WandbLoggerCallback

        init: dict[str, Any] = {"dir": str(folder)} if folder else {}
        if os.environ.get("WANDB_MODE"):  # the logging actors may run under a raylet's env, not ours
            init["mode"] = os.environ["WANDB_MODE"]
        callbacks.append(WandbLoggerCallback(project=cfg.tracking.wandb_project, group=experiment, **init))
    return callbacks


def _require_wandb_login() -> None:
    """Ray's W&B logger fails after Ray has started without a key; say so before, as one line."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled") or os.environ.get("WANDB_API_KEY"):
        return
    import wandb

    if wandb.login(prompt=False, verify=False):  # a key from `wandb login` or a settings file
        return
    raise UserError(
        "[tracking] wandb_project needs a W&B login: set WANDB_API_KEY (or run `wandb login`), or "
        "WANDB_MODE=offline to keep the runs in the experiment folder and `wandb sync` them later"
    )


def _require_extra(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"[tracking] needs {module}: pip install 'gptrun[{extra}]' (or unset it)")
