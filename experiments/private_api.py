"""The private Ray and Optuna names that gptrun relies on, each behind one function.

Ray and Optuna may change what is private in any release. Each function here says what it
reads, and was checked against the source of Ray 2.60.0 and Optuna 5.1.0 (the versions
pyproject.toml pins); after an upgrade, check each against the new source and run the tests
named beside it. Two more live in `experiments.cluster` (the address probe: `_resolve_auto`,
`_auth_metadata`) and one in `cluster/local.py` (`ray._raylet.GcsClient`), each with the same
version note.
"""

from __future__ import annotations

from typing import Any


def in_tune_session() -> bool:
    """Whether this Tune trial's session still runs: false once ASHA or the budget stopped the
    trial (aborting its Ray Train run), when a report would warn and change nothing.
    `ray.tune.trainable.trainable_fn_utils._in_tune_session` (Ray 2.60.0; tests/test_sweep.py
    `test_ddp_trial_stopped_by_asha_is_not_an_error`)."""
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    return _in_tune_session()


def optuna_trials(search: Any) -> dict[str, Any]:
    """Tune trial id -> the `optuna.Trial` that OptunaSearch asked for it: `_ot_trials`
    (Ray 2.60.0 `ray.tune.search.optuna.OptunaSearch`; tests/test_sweep.py, test_report.py)."""
    return search._ot_trials


def optuna_study(search: Any) -> Any:
    """The `optuna.Study` that OptunaSearch asks and tells: `_ot_study` (Ray 2.60.0)."""
    return search._ot_study


def told_trials(search: Any) -> set[str]:
    """The Tune trial ids OptunaSearch has told the study about (it skips them on a second
    completion): `_completed_trials`, a set (Ray 2.60.0)."""
    return search._completed_trials


def trial_checkpoints(trial: Any) -> tuple[list[Any], Any]:
    """(the checkpoints Tune keeps for `trial`, oldest first; the one it resumes the trial from,
    or None), as `ray.tune.Checkpoint`s: `_checkpoint_results` and `_latest_checkpoint_result`
    of `trial.run_metadata.checkpoint_manager` (Ray 2.60.0 `ray.train._internal.checkpoint_manager
    ._CheckpointManager`; tests/test_object_store.py `test_sweep_in_s3_survives_a_killed_driver`)."""
    manager = trial.run_metadata.checkpoint_manager
    latest = manager._latest_checkpoint_result
    return [r.checkpoint for r in manager._checkpoint_results], latest.checkpoint if latest else None


def trial_folder(trial: Any) -> tuple[Any, str]:
    """(pyarrow filesystem, path) of a Tune trial's folder on the experiment's storage, where its
    checkpoint folders are: `trial.storage.storage_filesystem` and `.trial_fs_path` (Ray 2.60.0
    `ray.train._internal.storage.StorageContext`; tests/test_sweep.py `test_kill_anywhere`)."""
    return trial.storage.storage_filesystem, trial.storage.trial_fs_path


def set_trial_checkpoints(trial: Any, kept: list[Any], latest: Any, index: int) -> None:
    """Make `kept` (oldest first, `latest` among them, or `latest` None) the checkpoints Tune
    keeps for `trial` and resumes it from, each keeping the metrics Tune had for it, and number
    the trial's next checkpoint folder `index + 1`: the `_CheckpointManager` fields above, as
    `ray.train._internal.session._TrainingResult`s (the latest must be one of the kept objects:
    the manager compares them by identity), and `trial.storage.current_checkpoint_index` (Ray
    2.60.0 `ray.train._internal.storage.StorageContext`)."""
    from ray.train._internal.session import _TrainingResult

    manager = trial.run_metadata.checkpoint_manager
    metrics = {r.checkpoint.path: r.metrics for r in manager._checkpoint_results}
    results = {c.path: _TrainingResult(checkpoint=c, metrics=metrics.get(c.path, {})) for c in kept}
    manager._checkpoint_results = list(results.values())
    manager._latest_checkpoint_result = results[latest.path] if latest else None
    trial.storage.current_checkpoint_index = index


def storage_trial_id(trial: Any) -> int:
    """The storage's id of an Optuna `FrozenTrial` (not its number), which `optuna.Trial(study,
    id)` takes to act on a trial asked by an earlier process: `_trial_id` (Optuna 5.1.0;
    tests/test_sweep.py `test_kill_anywhere`)."""
    return trial._trial_id


def reload_ray_auth() -> None:
    """Make this process read RAY_AUTH_MODE and its token again, once they are set or unset:
    Ray caches its config in the process (refreshed with `ray._raylet.Config.initialize("")`, as
    Ray 2.60.0 `ray._private.authentication.authentication_token_setup._enable_token_auth`
    does) and the token it loaded (`AuthenticationTokenLoader.instance().reset_cache()`, as
    `ensure_token_if_auth_enabled` does). tests/test_security.py."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def submitted_job_env_vars() -> dict[str, str]:
    """The env_vars of the runtime_env a Ray Job's submitter gave this driver (`ray job submit
    --runtime-env-json`, a KubeRay RayJob's `runtimeEnvYAML`), which `ray.init` merges with its
    own argument; empty outside a submitted job. Ray's job supervisor passes them in
    `RAY_JOB_CONFIG_JSON_ENV_VAR` as JSON (Ray 2.60.0 `ray.dashboard.modules.job.job_supervisor`,
    read by `ray._private.worker.init`; tests/test_cluster.py
    `test_the_drivers_ray_train_settings_reach_every_node`)."""
    import json
    import os

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    text = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if not text:
        return {}
    return (json.loads(text).get("runtime_env") or {}).get("env_vars") or {}
