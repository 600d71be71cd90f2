"""One sweep trial: the gptcore loop with the trial's sampled values, reporting to Ray Tune.

A 1-worker trial trains right here, in the Tune trial's own process, with the trial's CPUs/GPUs:
its checkpoints go through `tune.report` and it resumes from `tune.get_checkpoint()`. A new
TorchTrainer (controller, worker group, placement group) costs ~25 s before the first step, most
of a short trial. A trial with `resources.workers > 1` is one Ray Train DDP run, named
`train-<trial_id>` under `EXPERIMENT/runs/` so that it resumes from its own last checkpoint.

Either way a run that diverged, or whose sampled values the config refuses, reports a bad,
finite loss and its reason instead of raising, so the sweep goes on and the searcher learns that
this region is bad; any other failure (a bug, out of memory, a lost file) reports its reason as
an error, which the study records as FAIL (`experiments.outcome`). A trial that the study saw
end before a killed driver's resume ends again with that result, without training (`ended`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from experiments.objective import METRIC
from experiments.private_ray import in_tune_session
from experiments.ray_config import RayExperiment, experiment_from_dict
from experiments.ray_train import build_trainer, checkpoint_reporter, diverged_loss, resume, root_message
from experiments.sizing import is_lean, trial_tokens
from experiments.space import apply_overrides
from gptcore.errors import DivergedError, UserError


def run_trial(
    config: dict[str, Any], base: dict[str, Any], runs_storage: str, ended: dict[str, dict] | None = None
) -> None:
    """The Tune function trainable. `base` holds the experiment's config and its `Space` (which
    turns the sampled `config` into config values); `ended` maps the trials that had ended
    before a resume to the report that ends them again (`experiments.record.replay_result`)."""
    from ray import tune

    replay = (ended or {}).get(tune.get_context().get_trial_id())
    if replay is not None:
        tune.report(replay)
        return
    cfg = experiment_from_dict(base["config"])
    try:
        cfg = apply_overrides(cfg, base["space"].overrides(config))
    except UserError as err:  # sampled values the config refuses
        return _report_verdict(cfg, "refused", str(err))
    try:
        outcome = train_here(cfg) if is_lean(cfg) else train_ddp(cfg, runs_storage)
    except Exception as err:  # recorded with its reason; never crashes the sweep
        if not in_tune_session():  # ASHA or the budget stopped it, aborting its DDP run: no error
            return
        return _report_verdict(cfg, "error", root_message(err))
    if outcome.get("status") in ("diverged", "refused"):
        _report_verdict(cfg, outcome["status"], outcome["reason"])


def _report_verdict(cfg: RayExperiment, flag: str, reason: str) -> None:
    """The last report of a trial that diverged, was refused or failed: the bad score that ranks
    it (the study records an error as FAIL), its flag and its reason."""
    from ray import tune

    tune.report({METRIC: diverged_loss(cfg), "tokens": float(trial_tokens(cfg)), flag: 1.0, "reason": reason})


def train_here(cfg: RayExperiment) -> dict[str, str]:
    """The lean path: the loop in this process, checkpoints reported to Tune."""
    import ray
    import torch
    from ray import tune

    from gptcore.train import Trainer

    logging.getLogger("ray.train").setLevel(logging.WARNING)  # no line per checkpoint upload
    torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    trainer = Trainer(cfg)
    resume(trainer, tune.get_checkpoint())
    extra = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "world_size": 1.0,
        "fit_start_unix": time.time(),
    }
    try:
        trainer.fit(checkpoint_reporter(tune.report, tune.Checkpoint, extra))
    except DivergedError as err:
        return {"status": "diverged", "reason": str(err)}
    return {"status": "completed"}


def train_ddp(cfg: RayExperiment, runs_storage: str) -> dict[str, str]:
    """The DDP path: one Ray Train run whose rank 0 reports reach Tune through the callback."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    name = f"train-{tune.get_context().get_trial_id()}"
    trainer = build_trainer(
        cfg, storage=runs_storage, name=name, max_failures=1, callbacks=[TuneReportCallback()]
    )
    return trainer.fit().return_value or {}
