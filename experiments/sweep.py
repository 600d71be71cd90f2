"""`gptrun sweep` / `gptrun resume`: Ray Tune + Optuna (TPE) + ASHA over a config's search space.

One Tune trial = one Ray Train run named `train-<trial_id>` under `EXPERIMENT/runs/`, so a trial
that is interrupted (driver killed, node lost) continues from its own last checkpoint when the
sweep is restored. ASHA's clock is tokens seen (Tune's iteration counter restarts after a
restore). The experiment folder holds:

    gptrun.toml   the base config          sweep.json    how to resume (storage, name, ...)
    runs/         one Ray Train run/trial   optuna.db     the Optuna study, every trial once
    best.toml     the winner, ready to train (also printed with its checkpoint)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from experiments.cluster import (
    check_fits,
    local_resources,
    ray_session,
    require_resources,
    resolve_storage,
)
from experiments.space import Space, apply_overrides, parse_space
from experiments.train import build_trainer, checked_for_workers, diverged_loss, root_message
from gptcore.atomic import atomic_file, write_text_atomic
from gptcore.config import ExperimentConfig, load_config, parse_duration, run_budget
from gptcore.errors import UserError

TRIAL_DRIVER_CPU = 0.01  # the Tune trial function only waits on its trainer
METRIC, MODE = "val_loss", "min"
REPORT_COLUMNS = ["tokens", "loss", "val_loss", "val_bpb", "tokens_per_sec"]


def trial_tokens(cfg: ExperimentConfig) -> int:
    """The per-trial budget in tokens (ASHA's max_t)."""
    return run_budget(cfg, cfg.resources.workers).total_tokens


def grace_tokens(cfg: ExperimentConfig) -> int:
    return cfg.sweep.grace_tokens or max(1, trial_tokens(cfg) // 4)


def concurrency(cfg: ExperimentConfig, cpus: float, gpus: float) -> int:
    """How many trials fit at once: GPUs // GPUs per trial, or CPUs on a CPU cluster."""
    res = cfg.resources
    if res.gpus_per_worker > 0:
        fit = int(gpus // (res.workers * res.gpus_per_worker))
    else:
        fit = int(cpus // (res.workers * res.cpus_per_worker + TRIAL_DRIVER_CPU))
    if cfg.sweep.max_concurrent:
        fit = min(fit, cfg.sweep.max_concurrent)
    return max(fit, 0)


def run_trial(config: dict[str, Any], base: dict[str, Any], runs_storage: str,
              max_failures: int) -> None:
    """The Tune trial function: one Ray Train run with the sampled values.

    A diverged or failed run reports a bad, finite loss instead of raising, so the sweep goes on
    and the searcher learns that this region is bad."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from gptcore.config import config_from_dict

    space: Space = base["space"]
    cfg = apply_overrides(config_from_dict(base["config"]), space.overrides(config))
    name = f"train-{tune.get_context().get_trial_id()}"
    trainer = build_trainer(cfg, storage=runs_storage, name=name, max_failures=max_failures,
                            callbacks=[TuneReportCallback()])
    try:
        result = trainer.fit()
    except Exception as err:  # recorded with its reason; never crashes the sweep
        tune.report({METRIC: diverged_loss(cfg), "tokens": float(trial_tokens(cfg)),
                     "error": 1.0, "reason": root_message(err)})
        return
    outcome = result.return_value or {}
    if outcome.get("status") == "diverged":
        tune.report({METRIC: diverged_loss(cfg), "tokens": float(trial_tokens(cfg)),
                     "diverged": 1.0, "reason": outcome["reason"]})


def build_tuner(cfg: ExperimentConfig, space: Any, exp_dir: Path, max_concurrent: int, *,
                restore: bool = False, tune_config: Any = None, param_space: dict | None = None,
                stop: Any = None, tracking_name: str = "") -> Any:
    """The Tuner of experiment `exp_dir`: one `run_trial` per trial, `space.overrides(config)`
    turning a trial's config into config values. The search defaults to TPE + ASHA from
    `cfg.sweep` (`search_config`); `gptrun confirm` and the benchmarks pass their own. Trackers
    log under `tracking_name` (default: the experiment's name)."""
    from ray import tune

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's table reporter, not the new UI
    base = {"config": cfg.to_dict(), "space": space}
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, runs_storage=str(exp_dir / "runs"),
                             max_failures=1),
        {"cpu": TRIAL_DRIVER_CPU})
    if restore:
        return tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_errored=True)
    tune_config = tune_config or search_config(cfg, space, exp_dir.name)
    tune_config.max_concurrent_trials = max_concurrent
    reporter = tune.CLIReporter(metric_columns=REPORT_COLUMNS, max_report_frequency=30,
                                parameter_columns=list(space.keys), metric=METRIC, mode=MODE,
                                sort_by_metric=True)
    return tune.Tuner(
        trainable, param_space=param_space, tune_config=tune_config,
        run_config=tune.RunConfig(name=exp_dir.name, storage_path=str(exp_dir.parent),
                                  progress_reporter=reporter, verbose=1, stop=stop,
                                  callbacks=tracking_callbacks(cfg, tracking_name or exp_dir.name),
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )


def search_config(cfg: ExperimentConfig, space: Space, study_name: str) -> Any:
    """TPE (seeded, the baseline as its first point) + ASHA on tokens, within the budget."""
    import optuna
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    points = [space.baseline(cfg)] if cfg.sweep.baseline else None
    searcher = OptunaSearch(space=space.suggest, points_to_evaluate=points,
                            sampler=optuna.samplers.TPESampler(seed=cfg.sweep.seed),
                            study_name=study_name, metric=METRIC, mode=MODE)
    max_t = trial_tokens(cfg)
    scheduler = ASHAScheduler(time_attr="tokens", max_t=max_t,
                              grace_period=min(grace_tokens(cfg), max_t),
                              reduction_factor=cfg.sweep.reduction_factor, metric=METRIC,
                              mode=MODE)
    budget = parse_duration(cfg.sweep.budget) if cfg.sweep.budget else None
    return tune.TuneConfig(search_alg=searcher, scheduler=scheduler,
                           num_samples=cfg.sweep.num_samples, time_budget_s=budget)


def tracking_callbacks(cfg: ExperimentConfig, experiment: str) -> list[Any]:
    """MLflow / W&B loggers from `[tracking]`, empty unless the user set them (no network call
    otherwise). They run in the Tune driver on each trial's results, which are rank 0's reports;
    each trial is one MLflow run / W&B run in the experiment's name / group."""
    callbacks: list[Any] = []
    if cfg.tracking.mlflow_uri:
        _require_extra("mlflow", "mlflow")
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no calls home

        callbacks.append(MLflowLoggerCallback(tracking_uri=cfg.tracking.mlflow_uri,
                                              experiment_name=experiment, save_artifact=False))
    if cfg.tracking.wandb_project:
        _require_extra("wandb", "wandb")
        from ray.air.integrations.wandb import WandbLoggerCallback

        callbacks.append(WandbLoggerCallback(project=cfg.tracking.wandb_project, group=experiment))
    return callbacks


def _require_extra(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"[tracking] needs {module}: pip install 'gptrun[{extra}]' (or unset it)")


def sweep_cli(config: str, overrides: list[str], *, name: str | None, storage: str | None,
              address: str | None, restart: bool) -> int:
    cfg = checked_for_workers(load_config(config, overrides))
    space = parse_space(cfg)
    if cfg.sweep.baseline:
        space.baseline(cfg)  # check it now, not after Ray has started
    tracking_callbacks(cfg, "check")  # a missing tracking extra, before Ray starts
    storage = resolve_storage(storage, "sweeps")
    if "://" in storage:
        raise UserError("gptrun sweep keeps its experiment folder on a path (NFS on a cluster); "
                        "object-store URIs are supported by `gptrun train --storage`")
    exp_dir = Path(storage) / (name or cfg.name)
    if exp_dir.exists():
        if not restart:
            raise UserError(f"experiment {exp_dir} exists; continue it with `gptrun resume "
                            f"{exp_dir}` or start over with --restart")
        shutil.rmtree(exp_dir)
    res = cfg.resources
    need = (res.workers * res.cpus_per_worker + TRIAL_DRIVER_CPU, res.workers * res.gpus_per_worker)
    if address is None:  # a local instance: no need to start Ray to know it is too small
        check_fits(*need, "one trial", local_resources(extra_cpus=1))
    with ray_session(address, extra_local_cpus=1):
        cpus, gpus = _cluster_size()
        require_resources(*need, "one trial")
        width = concurrency(cfg, cpus, gpus)
        start_experiment(exp_dir, cfg, {"max_concurrent": width})
        print(f"sweep {exp_dir}: {cfg.sweep.num_samples} trials, {width} at a time, "
              f"{trial_tokens(cfg):,} tokens each, ASHA grace {grace_tokens(cfg):,} tokens"
              f"{', budget ' + cfg.sweep.budget if cfg.sweep.budget else ''}")
        build_tuner(cfg, space, exp_dir, width).fit()
        return finish(cfg, space, exp_dir)


def start_experiment(exp_dir: Path, cfg: ExperimentConfig, meta: dict[str, Any]) -> None:
    """The files that make `exp_dir` a gptrun experiment: the base config, and `sweep.json` (how
    to resume, and the per-trial budget that tells completed trials from stopped ones)."""
    exp_dir.mkdir(parents=True)
    write_text_atomic(exp_dir / "gptrun.toml", cfg.to_toml())
    write_text_atomic(exp_dir / "sweep.json", json.dumps(
        {"trial_tokens": trial_tokens(cfg), **meta}, indent=1))


def resume_cli(experiment_dir: str, *, address: str | None) -> int:
    from ray import tune

    exp_dir = Path(experiment_dir).expanduser().resolve()
    if not (exp_dir / "gptrun.toml").exists() or not tune.Tuner.can_restore(str(exp_dir)):
        raise UserError(f"{exp_dir} is not a gptrun sweep that can be resumed (no gptrun.toml or "
                        "Tune state); start one with `gptrun sweep CONFIG`")
    cfg = load_config(exp_dir / "gptrun.toml")
    space = parse_space(cfg)
    width = json.loads((exp_dir / "sweep.json").read_text())["max_concurrent"]
    with ray_session(address, extra_local_cpus=1):
        print(f"resuming sweep {exp_dir}")
        build_tuner(cfg, space, exp_dir, width, restore=True).fit()
        return finish(cfg, space, exp_dir)


def finish(cfg: ExperimentConfig, space: Space, exp_dir: Path) -> int:
    """Summary table, the Optuna study on disk, best.toml and the best checkpoint's path; then,
    with `sweep.confirm_top`, the noise check (`experiments/confirm.py`) in the same Ray session."""
    from experiments.results import load_trials, print_table

    export_study(exp_dir, cfg)
    trials = load_trials(exp_dir)
    print_table(trials)
    ok = [t for t in trials if t["status"] in ("completed", "stopped early")]
    if not ok:
        print("no trial finished without error; see the reasons above")
        return 1
    best = min(ok, key=lambda t: t["val_loss"])
    best_cfg = apply_overrides(cfg, space.overrides(best["config"]))
    best_cfg = apply_overrides(best_cfg, {"train.out": f"runs/{exp_dir.name}-best"})
    write_text_atomic(exp_dir / "best.toml", best_cfg.to_toml())
    print(f"best trial {best['trial_id']}: val loss {best['val_loss']:.4f} | config "
          f"{exp_dir / 'best.toml'} | checkpoint {best['checkpoint']}")
    print(f"train it at full length: gptrun train {exp_dir / 'best.toml'}")
    if cfg.sweep.confirm_top:
        from experiments.confirm import confirm, confirm_plan

        plan = confirm_plan(exp_dir, cfg, cfg.sweep.confirm_top, cfg.sweep.confirm_seeds)
        return confirm(exp_dir, cfg, plan, restart=False)
    return 0


def export_study(exp_dir: Path, cfg: ExperimentConfig) -> None:
    """Write the searcher's Optuna study (restored from Tune's state) to an RDB.

    The study lives in memory inside the searcher, which Tune checkpoints with the experiment, so
    a killed and resumed sweep neither loses nor repeats a trial; the RDB copy is written from it
    (sqlite in the experiment folder by default, or any SQLAlchemy URL in `sweep.storage_url`)."""
    from ray.tune.search.optuna import OptunaSearch

    searcher = OptunaSearch()
    searcher.restore_from_dir(str(exp_dir))
    study = searcher._ot_study  # Ray keeps the study private; it is the TPE history itself
    tune_ids = {t.number: tid for tid, t in searcher._ot_trials.items()}
    if cfg.sweep.storage_url:
        _copy_study(study, tune_ids, cfg.sweep.storage_url, exp_dir.name)
        return
    with atomic_file(exp_dir / "optuna.db") as tmp:
        _copy_study(study, tune_ids, f"sqlite:///{tmp}", exp_dir.name)


def _copy_study(study: Any, tune_ids: dict[int, str], url: str, name: str) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with contextlib.suppress(KeyError):
        optuna.delete_study(study_name=name, storage=url)
    target = optuna.create_study(study_name=name, storage=url, direction="minimize")
    for trial in study.get_trials(deepcopy=True):
        if trial.state.is_finished():
            trial.set_user_attr("tune_trial_id", tune_ids.get(trial.number, ""))
            target.add_trial(trial)


def _cluster_size() -> tuple[float, float]:
    import ray

    total = ray.cluster_resources()
    return total.get("CPU", 0.0), total.get("GPU", 0.0)
