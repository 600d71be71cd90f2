"""The private Ray names that gptrun relies on, each behind one function (the fence: see
`gptcore.fence`; `gptrun doctor` checks every entry of `FENCED`).

Ray may change what is private in any release. Each function here says what it reads, and was
checked against the source of Ray 2.60.0 (the version pyproject.toml pins); after an upgrade,
check each against the new source and run the test named in its `FENCED` entry. Optuna's are in
`experiments.private_optuna`, torch's in `gptcore.private_torch`.
"""

from __future__ import annotations

import json
from typing import Any

from gptcore.fence import Private, require

RAY = "ray 2.60.0"


def _ray(module: str, name: str, test: str) -> Private:
    return Private(module, name, RAY, test)


AUTOSCALE_TEST = "tests/test_autoscale.py::test_plan_shows_what_the_cluster_can_grow_to"
KILL_TEST = "tests/test_sweep.py::test_kill_anywhere"
S3_KILL_TEST = "tests/test_object_store.py::test_sweep_in_s3_survives_a_killed_driver"

TUNE_SESSION = _ray(
    "ray.tune.trainable.trainable_fn_utils",
    "_in_tune_session",
    "tests/test_sweep.py::test_ddp_trial_stopped_by_asha_is_not_an_error",
)
OT_TRIALS = _ray("ray.tune.search.optuna", "OptunaSearch.self._ot_trials", KILL_TEST)
OT_STUDY = _ray("ray.tune.search.optuna", "OptunaSearch.self._ot_study", KILL_TEST)
TOLD = _ray("ray.tune.search.optuna", "OptunaSearch.self._completed_trials", KILL_TEST)
CHECKPOINT_MANAGER = _ray(
    "ray.train._internal.checkpoint_manager",
    "_CheckpointManager.self._checkpoint_results",
    S3_KILL_TEST,
)
LATEST_CHECKPOINT = _ray(
    "ray.train._internal.checkpoint_manager",
    "_CheckpointManager.self._latest_checkpoint_result",
    S3_KILL_TEST,
)
TRAINING_RESULT = _ray("ray.train._internal.session", "_TrainingResult", S3_KILL_TEST)
TRIAL_FS_PATH = _ray("ray.train._internal.storage", "StorageContext.trial_fs_path", KILL_TEST)
CHECKPOINT_INDEX = _ray(
    "ray.train._internal.storage", "StorageContext.self.current_checkpoint_index", KILL_TEST
)
RAY_CONFIG = _ray("ray._raylet", "Config.initialize", "tests/test_security.py")
TOKEN_LOADER = _ray("ray._raylet", "AuthenticationTokenLoader", "tests/test_security.py")
AUTH_MODE = _ray(
    "ray._raylet",
    "get_authentication_mode",
    "tests/test_cluster.py::test_client_without_the_token_is_refused",
)
JOB_CONFIG_ENV = _ray(
    "ray._private.runtime_env.constants",
    "RAY_JOB_CONFIG_JSON_ENV_VAR",
    "tests/test_cluster.py::test_the_drivers_ray_train_settings_reach_every_node",
)
BOOTSTRAP_ADDRESS = _ray(
    "ray._private.services",
    "canonicalize_bootstrap_address_or_die",
    "tests/test_cluster.py::test_ray_address_is_the_cluster_checked_not_this_machine",
)
TOKEN_IF_AVAILABLE = _ray(
    "ray._private.authentication.authentication_token_setup",
    "maybe_enable_token_auth_if_token_available",
    "tests/test_cluster.py::test_ray_address_is_the_cluster_checked_not_this_machine",
)
HEAD_RESOURCE_NAME = _ray("ray._common.constants", "HEAD_NODE_RESOURCE_NAME", AUTOSCALE_TEST)
CLUSTER_CONFIG = _ray("ray._private.state", "state.get_cluster_config", AUTOSCALE_TEST)
AUTOSCALING_STATUS_KEY = _ray(
    "ray._private.ray_constants",
    "DEBUG_AUTOSCALING_STATUS",
    AUTOSCALE_TEST,
)
INTERNAL_KV = _ray("ray.experimental.internal_kv", "_internal_kv_get", AUTOSCALE_TEST)
AUTOSCALER_V2 = _ray("ray.autoscaler.v2.utils", "is_autoscaler_v2", AUTOSCALE_TEST)
MONITOR_FLAGS = _ray(
    "ray.autoscaler._private.monitor",
    '"--autoscaling-config"',
    AUTOSCALE_TEST,
)
MONITOR_GCS_FLAG = _ray(
    "ray.autoscaler._private.monitor",
    '"--gcs-address"',
    AUTOSCALE_TEST,
)
GCS_CLIENT = _ray(
    "ray._raylet",
    "GcsClient",
    "tests/test_autoscale.py::test_sweep_grows_the_cluster_from_nothing_and_lets_it_shrink",
)
FENCED = [
    TUNE_SESSION, OT_TRIALS, OT_STUDY, TOLD, CHECKPOINT_MANAGER, LATEST_CHECKPOINT, TRAINING_RESULT,
    TRIAL_FS_PATH, CHECKPOINT_INDEX, RAY_CONFIG, TOKEN_LOADER, AUTH_MODE, JOB_CONFIG_ENV,
    BOOTSTRAP_ADDRESS, TOKEN_IF_AVAILABLE, HEAD_RESOURCE_NAME, CLUSTER_CONFIG, AUTOSCALING_STATUS_KEY,
    INTERNAL_KV, AUTOSCALER_V2, MONITOR_FLAGS, MONITOR_GCS_FLAG, GCS_CLIENT,
]  # fmt: skip


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
    import os

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    text = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if not text:
        return {}
    return (json.loads(text).get("runtime_env") or {}).get("env_vars") or {}


def resolve_auto_address() -> str:
    """`--address auto` as `ray.init(address="auto")` resolves it (RAY_ADDRESS, then the newest
    local cluster), with token auth turned on first when a token is available, as ray.init does
    for a cluster it finds by itself: `ray._private.services.canonicalize_bootstrap_address_or_die`
    and `...authentication_token_setup.maybe_enable_token_auth_if_token_available`. Raises
    ConnectionError when there is none."""
    require(TOKEN_IF_AVAILABLE)
    require(BOOTSTRAP_ADDRESS)
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )
    from ray._private.services import canonicalize_bootstrap_address_or_die

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    return canonicalize_bootstrap_address_or_die("auto")


def token_header() -> tuple[dict[str, str] | None, bool]:
    """(the authorization header `ray.init` will send, or None without a token; whether
    RAY_AUTH_MODE asks for a token), from Ray's own token loader, which honours RAY_AUTH_MODE,
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token in Ray's order: `ray._raylet`'s
    `AuthenticationTokenLoader` and `get_authentication_mode`."""
    require(TOKEN_LOADER)
    require(AUTH_MODE)
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode

    loader = AuthenticationTokenLoader.instance()
    try:
        has_token = loader.has_token()
    except Exception:  # Ray raises AuthenticationError when the mode is token and none is found
        has_token = False
    wanted = get_authentication_mode() == AuthenticationMode.TOKEN
    return (dict(loader.get_token_for_http_header()) if has_token else None), wanted


def head_resource() -> str:
    """The resource only the head node has (`ray._common.constants.HEAD_NODE_RESOURCE_NAME`)."""
    require(HEAD_RESOURCE_NAME)
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    return HEAD_NODE_RESOURCE_NAME


def reported_cluster_config() -> Any:
    """The autoscaler cluster config in the GCS's KV store, None when no autoscaler reported
    one: `ray._private.state.state.get_cluster_config()` (the source Ray Data reads)."""
    require(CLUSTER_CONFIG)
    from ray._private.state import state

    return state.get_cluster_config()


def autoscaler_report() -> dict | None:
    """The v1 monitor's `autoscaler_report` from its status in the GCS's KV store (the key `ray
    status` reads: `ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS`), None when no monitor
    wrote one."""
    require(AUTOSCALING_STATUS_KEY)
    require(INTERNAL_KV)
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    return (json.loads(raw).get("autoscaler_report") or {}) if raw else None


def autoscaler_v2_on() -> bool:
    """Whether the cluster runs Ray's autoscaler v2 (KubeRay's default):
    `ray.autoscaler.v2.utils.is_autoscaler_v2`."""
    require(AUTOSCALER_V2)
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    return is_autoscaler_v2()


def monitor_autoscaling_config(args: list[str], gcs_port: str) -> str | None:
    """The `--autoscaling-config` path in the command line `args` of a process, when it is Ray's
    monitor serving the GCS on `gcs_port` (`ray.autoscaler._private.monitor`'s flags
    `--autoscaling-config` and `--gcs-address`); else None."""
    config = next((a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")), None)
    serves = any(a.startswith("--gcs-address=") and a.endswith(f":{gcs_port}") for a in args)
    return config if serves else None


def gcs_node_infos(address: str, timeout: float) -> list[Any]:
    """Every node the GCS at `address` knows (alive and dead), as Ray's `GcsNodeInfo`s, without
    joining the cluster: `ray._raylet.GcsClient(address).get_all_node_info`."""
    require(GCS_CLIENT)
    from ray._raylet import GcsClient

    return list(GcsClient(address=address).get_all_node_info(timeout=timeout).values())
