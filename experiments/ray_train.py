"""`gptrun train` on Ray: the gptcore loop in every worker of a Ray Train `TorchTrainer` (V2 API).

Each worker builds a `gptcore.train.Trainer` with its rank and world size and a DDP wrapper; rank 0
writes the checkpoint that `ray.train.report` commits. The run has a stable name under a fixed
storage path, so running the same command again (or a worker-group restart after a failure)
resumes from the last committed checkpoint.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.autoscale import room_for
from experiments.cluster import (
    check_fits,
    check_storage,
    create_storage,
    is_local,
    local_resources,
    ray_session,
    verify_shared_storage,
    verify_trial_nodes,
)
from experiments.ray_config import RayExperiment, checked_for_workers, experiment_from_dict
from gptcore.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from gptcore.errors import DivergedError, UserError


def worker_loop(loop_config: dict[str, Any]) -> dict[str, str]:
    """Runs inside each Ray Train worker. Resumes from Ray's latest checkpoint if there is one."""
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gptcore.tracking import TensorBoardLog
    from gptcore.train import Trainer

    cfg = experiment_from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(loop_config["cpus_per_worker"])))
    if loop_config["use_gpu"]:
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if world_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)

    trainer = Trainer(cfg, rank=rank, world_size=world_size, device=device, wrap=wrap)
    try:
        resume(trainer, ray.train.get_checkpoint())
    except UserError as err:  # another length or shape: a retry would fail the same way
        return {"status": "refused", "reason": str(err)}
    tensorboard = (
        TensorBoardLog(loop_config["tensorboard_dir"])
        if rank == 0 and loop_config["tensorboard_dir"]
        else None
    )
    extra = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "world_size": float(world_size),
        "fit_start_unix": time.time(),
    }
    report = checkpoint_reporter(ray.train.report, ray.train.Checkpoint, extra)

    def on_report(metrics: dict[str, float], state: dict[str, Any] | None) -> None:
        if tensorboard is not None:
            tensorboard.log(metrics)
        report(metrics, state if rank == 0 else None)  # rank 0 writes the checkpoint

    try:
        trainer.fit(on_report)
    except DivergedError as err:  # every rank raises at the same step (the loss is all-reduced)
        ray.train.report(
            {
                "step": float(trainer.step),
                "tokens": float(trainer.tokens_seen),
                "val_loss": diverged_loss(cfg),
                "diverged": 1.0,
            }
        )
        return {"status": "diverged", "reason": str(err)}
    finally:
        if tensorboard is not None:
            tensorboard.close()
    return {"status": "completed"}


def checkpoint_reporter(
    report: Callable[..., None], checkpoint_cls: Any, extra: dict[str, float | str]
) -> Callable[[dict[str, float], Any], None]:
    """gptcore's `on_report` for Ray: metrics plus `extra` (node id, when training started), and
    the checkpoint when the loop hands one. `report` is `ray.train.report` in a Train worker and
    `ray.tune.report` in a 1-worker sweep trial; both upload the folder to the run's storage."""

    def on_report(metrics: dict[str, float], state: dict[str, Any] | None) -> None:
        metrics = {**metrics, **extra, "report_unix": time.time()}
        if state is None:
            report(metrics)
            return
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(Path(folder) / CHECKPOINT_FILE, state)
            report(metrics, checkpoint=checkpoint_cls.from_directory(folder))

    return on_report


def resume(trainer: Any, checkpoint: Any) -> None:
    """Load Ray's latest checkpoint (Train's or Tune's) into `trainer`, if there is one."""
    if checkpoint is None:
        return
    with checkpoint.as_directory() as folder:
        trainer.load_state_dict(load_checkpoint(Path(folder) / CHECKPOINT_FILE))
    trainer.log(f"resumed from checkpoint at step {trainer.step}/{trainer.total_steps}")


def diverged_loss(cfg: RayExperiment) -> float:
    """What a diverged or failed run scores: worse than guessing uniformly over the vocabulary,
    finite so that TPE and ASHA can rank it."""
    return 2 * math.log(cfg.model.vocab_size)


def build_trainer(
    cfg: RayExperiment, *, storage: str, name: str, max_failures: int, callbacks: list | None = None
) -> Any:
    """A `TorchTrainer` for one run; `experiments.sweep` builds one of these per trial."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    res = cfg.resources
    use_gpu = res.gpus_per_worker > 0
    resources = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus_per_worker} if use_gpu else {})}
    run_dir = f"{storage.rstrip('/')}/{name}"
    loop_config = {
        "config": cfg.to_dict(),
        "use_gpu": use_gpu,
        "cpus_per_worker": res.cpus_per_worker,
        "tensorboard_dir": f"{run_dir}/tensorboard" if is_local(storage) else "",
    }
    return TorchTrainer(
        worker_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=res.workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            callbacks=callbacks,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=cfg.train.keep_checkpoints or None,
                checkpoint_score_attribute="val_loss",
                checkpoint_score_order="min",
            ),
        ),
    )


def error_chain(err: BaseException) -> list[BaseException]:
    """`err` and the errors Ray wrapped in it (worker failures, their causes), outermost first."""
    chain: list[BaseException] = []
    for cause in [err, *getattr(err, "worker_failures", {}).values()]:
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = getattr(cause, "cause", None) or cause.__cause__
    return chain


def raise_root_cause(err: Exception) -> None:
    """Turn a worker's UserError / DivergedError back into itself, so the CLI prints one line."""
    for cause in error_chain(err):
        if isinstance(cause, (UserError, DivergedError)):
            raise cause
    raise err


def root_message(err: BaseException) -> str:
    """The last line of the innermost error: what a sweep records as a failed trial's reason."""
    cause = error_chain(err)[-1]
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(cause).__name__)[:300]


RAY_RUNS = "runs/ray"  # Ray runs' default --storage: apart from `--local` runs (train.out, runs/NAME)


def ray_run_folder(out: str | None, storage: str | None, name: str | None) -> tuple[str | None, str | None]:
    """`--storage` and `--name` of a Ray run, from `--out` when it is given: the run's folder
    itself (its parent is the storage, its last part the name), as `--out` is for `--local`."""
    if out is None:
        return storage, name
    if storage or name:
        raise UserError(
            f"--out {out} names the run folder; give either --out, or --storage and --name "
            "(the run folder is STORAGE/NAME)"
        )
    parent, _, leaf = (
        (out if "://" in out else str(Path(out).expanduser().resolve())).rstrip("/").rpartition("/")
    )
    if not leaf or not parent or parent.endswith(":/"):
        raise UserError(f"--out {out}: give a folder inside a storage path or URI, e.g. runs/ray/NAME")
    return parent, leaf


def train_on_ray(
    cfg: RayExperiment, *, address: str | None, storage: str | None, name: str | None, max_failures: int
) -> int:
    """One run on Ray; `address` is already resolved (`--address` or $RAY_ADDRESS, None: a local
    instance, checked against this machine before Ray starts)."""
    import ray

    cfg = checked_for_workers(cfg)
    storage = check_storage(storage, RAY_RUNS)
    name = name or cfg.name
    if max_failures < -1:
        raise UserError(f"--max-failures={max_failures} must be >= -1 (-1 retries forever)")
    res = cfg.resources
    need = (res.workers * res.cpus_per_worker, res.workers * res.gpus_per_worker)
    if address is None and not ray.is_initialized():
        check_fits(*need, f"--workers {res.workers}", local_resources())
    worker = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus_per_worker} if res.gpus_per_worker else {})}
    with (
        ray_session(address),
        room_for([worker] * res.workers, 1, f"--workers {res.workers}", lambda c, g: 1),
    ):
        create_storage(storage)
        verify_shared_storage(storage)  # a resumed worker must find the checkpoints
        verify_trial_nodes(cfg.data.dir)  # every worker: our versions, its data
        print(
            f"run {name!r} under {storage} ({res.workers} worker(s), "
            f"{res.cpus_per_worker:g} CPU + {res.gpus_per_worker:g} GPU each); rerun the same "
            "command to resume"
        )
        trainer = build_trainer(cfg, storage=storage, name=name, max_failures=max_failures)
        try:
            result = trainer.fit()
        except Exception as err:  # Ray wraps worker errors in TrainingFailedError
            raise_root_cause(err)
    outcome = result.return_value or {}
    if outcome.get("status") == "refused":
        raise UserError(outcome["reason"])
    if outcome.get("status") == "diverged":
        raise DivergedError(outcome["reason"])
    best = result.get_best_checkpoint("val_loss", "min")
    metrics = result.metrics or {}
    print(
        f"done: step {metrics.get('step', 0):.0f}, val loss {metrics.get('val_loss', float('nan')):.4f}"
        f" | best checkpoint {best.path if best else None} | last checkpoint "
        f"{result.checkpoint.path if result.checkpoint else None}"
    )
    return 0
