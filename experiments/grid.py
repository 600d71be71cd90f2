"""Experiments that train a fixed list of configs as Tune trials: a grid, no search, no early
stopping. `gptrun confirm` (the best configs x new seeds) and `gptrun scale` (budgets x widths)
run here. Killed, the same command resumes the grid from Tune's state; a different grid in the
same folder needs --restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import remote
from experiments.experiment import remove_experiment, saved_meta, start_experiment
from experiments.ray_config import RayExperiment
from experiments.tuner import new_tuner, restore_tuner
from gptcore.errors import UserError


def run_grid(
    cfg: RayExperiment,
    space: Any,
    exp_dir: Path,
    width: int,
    *,
    grid: dict[str, list[Any]],
    meta: dict[str, Any],
    restore: bool,
    tracking_name: str,
) -> None:
    """Train every point of `grid`, `width` at a time. `restore` (see `resumable`) continues the
    interrupted grid; otherwise the folder starts anew with `meta`."""
    if not restore:
        remove_experiment(exp_dir)  # --restart, or killed before Tune saved anything
        start_experiment(exp_dir, cfg, meta)
    grid_tuner(cfg, space, exp_dir, width, grid=grid, restore=restore, tracking_name=tracking_name).fit()


def grid_tuner(
    cfg: RayExperiment,
    space: Any,
    exp_dir: Path,
    width: int,
    *,
    grid: dict[str, list[Any]],
    restore: bool,
    tracking_name: str,
) -> Any:
    """The grid's Tuner: every point of `grid` ({Tune config key: values}, their product), which
    `space.overrides(config)` turns into config values; no searcher, no scheduler and no
    budget (a sweep's `sweep.budget` is not a grid's); or the interrupted one, restored."""
    from ray import tune

    if restore:
        return restore_tuner(cfg, space, exp_dir)
    param_space = {key: tune.grid_search(values) for key, values in grid.items()}
    return new_tuner(
        cfg,
        space,
        exp_dir,
        width,
        tune_config=tune.TuneConfig(),
        param_space=param_space,
        tracking_name=tracking_name,
    )


def resumable(
    exp_dir: Path, plan: dict[str, Any], restart: bool, held: Callable[[dict[str, Any]], str]
) -> bool:
    """True to resume an earlier grid of the same `plan` (its keys as `meta` saved them) in
    `exp_dir`. A different plan without `restart` is refused, naming what the folder holds
    (`held(saved meta)`). Deletes nothing (`run_grid` does, once the cluster has answered)."""
    from ray import tune

    if not exp_dir.exists():
        return False
    saved = saved_meta(exp_dir)
    same = {k: saved.get(k) for k in plan} == plan
    if same and not restart and tune.Tuner.can_restore(remote.location(exp_dir)):
        return True
    if not same and not restart and saved:
        raise UserError(f"{exp_dir} holds {held(saved)}; rerun with those, or pass --restart to replace it")
    return False
