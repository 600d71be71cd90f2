"""`gptrun confirm`: how much of a sweep's spread is seed noise.

A sweep runs every config once, with one seed, so its winner is partly luck: the best of N noisy
draws. Confirm re-runs the K best trials (completed ones first, see `experiments.outcome.ranked`) with S new
seeds (`train.seed + 1 .. + S`, new weight init and data order) at full length, as a Tune
experiment in `EXPERIMENT/confirm/` (a grid over candidate x seed; killed, it resumes like a
sweep), and writes `EXPERIMENT/noise.json`:

- each candidate's losses, mean and std over the new seeds (the sweep's own run is left out: it
  was selected for being low);
- a Welch two-sample t-test between the best mean and the runner-up, and a verdict at alpha 0.05;
- the noise fraction: the seed variance (pooled within configs over the re-runs) over the variance
  of the final losses of the sweep's completed trials, the spread the user saw in its table (all at
  full budget; trials stopped early or cut by the budget are left out, their losses are at fewer
  tokens). Near 1, the sweep's differences are mostly seed noise; near 0, the config matters much
  more than the seed. The t-test answers the narrower question about the top two.

The figures and the sentences that read them live in `experiments.noise`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.autoscale import room_for
from experiments.cluster import ray_session, verify_trial_nodes
from experiments.experiment import (
    open_experiment,
    read_meta,
    save,
)
from experiments.grid import resumable, run_grid
from experiments.noise import NOISE_FILE, measure_noise, print_noise
from experiments.outcome import ranked
from experiments.ray_config import RayExperiment, load_experiment
from experiments.results import load_trials
from experiments.sizing import local_extra_cpus, trial_bundles
from experiments.space import parse_space
from gptcore.errors import UserError

CONFIRM_DIR = "confirm"


@dataclass(frozen=True)
class Candidates:
    """What a confirm trial's Tune config means: `candidate` (a sweep trial id) names the config
    values to re-run, `train.seed` the new seed. The `Space` of a confirm experiment."""

    values: dict[str, dict[str, Any]]  # sweep trial id -> its config values

    keys = ("candidate", "train.seed")

    def overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**self.values[config["candidate"]], "train.seed": config["train.seed"]}


def confirm_cli(experiment_dir: str, *, top: int, seeds: int, address: str | None, restart: bool) -> int:
    exp_dir = open_experiment(experiment_dir)
    cfg = load_experiment(exp_dir / "gptrun.toml") if (exp_dir / "gptrun.toml").exists() else None
    if cfg is None:
        raise UserError(
            f"{exp_dir} is not a gptrun sweep folder (no gptrun.toml); pass the "
            "folder that `gptrun sweep` printed"
        )
    if top < 1 or seeds < 2:
        raise UserError(
            f"--top {top} --seeds {seeds}: need --top >= 1 and --seeds >= 2 (a spread needs two runs)"
        )
    plan = confirm_plan(exp_dir, cfg, top, seeds)  # before Ray starts: bad input, no Ray
    _can_restore(exp_dir / CONFIRM_DIR, plan, restart)  # a different plan without --restart
    with ray_session(address, extra_local_cpus=local_extra_cpus(cfg)):
        return confirm(exp_dir, cfg, plan, restart=restart)


def confirm_plan(exp_dir: Path, cfg: RayExperiment, top: int, seeds: int) -> dict[str, Any]:
    """The candidates (the `top` best trials) and the new seeds."""
    candidates = ranked(load_trials(exp_dir))
    if not candidates:
        raise UserError(
            f"{exp_dir} has no trial that finished without error; finish the sweep "
            f"first (`gptrun resume {exp_dir}`)"
        )
    if len(candidates) < top:
        print(f"note: only {len(candidates)} trials finished; confirming those, not {top}")
    return {
        "candidates": [t["trial_id"] for t in candidates[:top]],
        "seeds": [cfg.train.seed + i for i in range(1, seeds + 1)],
    }


def confirm(exp_dir: Path, cfg: RayExperiment, plan: dict[str, Any], *, restart: bool) -> int:
    """Run (or resume) the confirm experiment inside a Ray session; write and print the noise.
    An earlier confirm that is not resumed is deleted only once the cluster has answered."""
    sweep_trials = load_trials(exp_dir)
    space = parse_space(cfg)
    by_id = {t["trial_id"]: t for t in sweep_trials}
    candidates = Candidates({tid: space.overrides(by_id[tid]["config"]) for tid in plan["candidates"]})
    conf_dir = exp_dir / CONFIRM_DIR
    meta = read_meta(exp_dir)
    width = meta["max_concurrent"]
    restore = _can_restore(conf_dir, plan, restart)
    n_runs = len(plan["candidates"]) * len(plan["seeds"])
    print(
        f"confirm {conf_dir}: {len(plan['candidates'])} configs x seeds {plan['seeds']} = "
        f"{n_runs} runs at full length{' (resuming)' if restore else ''}"
    )
    with room_for(trial_bundles(cfg), width, "one run", None):
        verify_trial_nodes(cfg.data.dir)
        run_grid(
            cfg,
            candidates,
            conf_dir,
            width,
            grid={"candidate": plan["candidates"], "train.seed": plan["seeds"]},
            meta={**meta, **plan},
            restore=restore,
            tracking_name=f"{exp_dir.name}-confirm",
        )
    noise = measure_noise(sweep_trials, load_trials(conf_dir), plan)
    save(exp_dir, NOISE_FILE, json.dumps(noise, indent=1))
    print_noise(noise)
    print(f"noise written to {exp_dir / NOISE_FILE}")
    return 0


def _can_restore(conf_dir: Path, plan: dict[str, Any], restart: bool) -> bool:
    return resumable(
        conf_dir,
        plan,
        restart,
        lambda saved: f"a confirm of {len(saved['candidates'])} configs x {len(saved['seeds'])} seeds",
    )
