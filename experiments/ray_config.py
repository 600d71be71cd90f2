"""The Ray side's config tables: `[resources]`, `[sweep]` and `[tracking]`.

gptcore owns `[model]`, `[data]`, `[optim]` and `[train]`; these three describe how a run is
placed on a cluster, searched and tracked, which the model world never reads. `RayExperiment` is
gptcore's `ExperimentConfig` with them added, and `load_experiment` reads a TOML into it with the
same key checking (unknown keys named, close matches suggested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptcore.config import ExperimentConfig, config_from_dict, load_config, require_positive
from gptcore.errors import UserError


@dataclass
class ResourcesConfig:
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0

    def validate(self) -> None:
        require_positive("resources.workers", self.workers)
        if self.gpus_per_worker < 0:
            raise UserError(f"resources.gpus_per_worker={self.gpus_per_worker} must be >= 0")
        if not self.cpus_per_worker > 0:
            raise UserError(f"resources.cpus_per_worker={self.cpus_per_worker} must be > 0")


@dataclass
class SweepConfig:
    """The search. `space` maps a key (`lr`, `weight_decay`, `warmup`, or any `section.key`)
    to a distribution; experiments.sweep validates it, since only it knows how to sample."""

    num_samples: int = 8
    seed: int = 0
    # The whole sweep's budget: wall-clock ("2h", "30m", "900s") or the tokens all its trials
    # train, summed ("20M tokens"); "" = none. `parse_budget` reads it.
    budget: str = ""
    max_concurrent: int = 0  # 0 means derived from the cluster
    baseline: bool = True  # trial 0 runs the config's own values (points_to_evaluate)
    grace_tokens: int = 0  # ASHA: tokens before the first cut; 0 means a quarter of the trial
    reduction_factor: int = 2
    storage_url: str = ""  # Optuna RDB; "" means sqlite in the experiment folder
    confirm_top: int = 0  # after the search, re-run the K best configs (0: no noise check) ...
    confirm_seeds: int = 3  # ... with this many new seeds each, at full length
    # TPE for trials that run at once: one model of all parameters (multivariate), trials still
    # running counted as bad guesses so that K trials asked together spread out (constant liar),
    # a conditional space (include_zero) modelled in groups (with multivariate). All false:
    # Optuna's plain, independent TPE.
    multivariate: bool = True
    constant_liar: bool = True
    group: bool = True
    warm_start: str = ""  # an earlier sweep on the same space (folder, or study name): TPE's history
    space: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        require_positive("sweep.num_samples", self.num_samples)
        if self.reduction_factor < 2:
            raise UserError(f"sweep.reduction_factor={self.reduction_factor} must be >= 2")
        for key in ("max_concurrent", "grace_tokens", "confirm_top"):
            if getattr(self, key) < 0:
                raise UserError(f"sweep.{key}={getattr(self, key)} must be >= 0")
        if self.confirm_seeds < 2:
            raise UserError(
                f"sweep.confirm_seeds={self.confirm_seeds} must be >= 2 (a spread needs two runs)"
            )
        if self.budget:
            parse_budget(self.budget)


@dataclass
class TrackingConfig:
    """Optional experiment trackers for sweeps, fed from rank 0's reports. Off unless set; each
    needs its extra (`pip install 'gptrun[mlflow]'` / `'gptrun[wandb]'`)."""

    mlflow_uri: str = ""  # e.g. "sqlite:///mlflow.db" or "http://mlflow:5000"
    wandb_project: str = ""  # W&B project; WANDB_API_KEY (or WANDB_MODE=offline) from the env


@dataclass(frozen=True)
class SweepLimit:
    """`sweep.budget` read: `amount` seconds of wall-clock, or (`tokens`) tokens trained by all
    the sweep's trials together."""

    amount: float
    tokens: bool = False

    def __str__(self) -> str:
        return f"{self.amount:,.0f} tokens" if self.tokens else f"{self.amount:g}s"


TOKEN_SCALES = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def parse_budget(text: str) -> SweepLimit:
    """'2h' / '90m' / '1h30m' / '900s' / '3600' -> seconds; '20M tokens' / '500k tokens' /
    '2e7 tokens' -> tokens. One key for both, as one notion has one name: the unit says which."""
    words = text.strip().lower()
    if not words.endswith("tokens"):
        return SweepLimit(parse_duration(text))
    number = words.removesuffix("tokens").strip()
    scale = TOKEN_SCALES.get(number[-1:], 1.0)
    if number[-1:] in TOKEN_SCALES:
        number = number[:-1]
    try:
        total = float(number) * scale
    except ValueError:
        raise UserError(
            f"sweep.budget={text!r} is not a number of tokens; write e.g. '20M tokens' or '500k tokens'"
        ) from None
    if not 0 < total < math.inf:
        raise UserError(f"sweep.budget={text!r} must be a positive, finite number of tokens")
    return SweepLimit(total, tokens=True)


def parse_duration(text: str) -> float:
    """'2h' / '90m' / '30s' / '1h30m' / '3600' -> seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    rest, total, number = text.strip().lower(), 0.0, ""
    try:
        for ch in rest:
            if ch.isdigit() or ch == ".":
                number += ch
            elif ch in units and number:
                total, number = total + float(number) * units[ch], ""
            else:
                raise ValueError
        total += float(number) if number else 0.0
    except ValueError:
        raise UserError(
            f"sweep.budget={text!r} is neither a duration nor tokens; write e.g. '2h', '30m', "
            "'1h30m', '900s' or '20M tokens'"
        ) from None
    if not 0 < total < math.inf:  # a number too long for a float is inf
        raise UserError(f"sweep.budget={text!r} must be a positive, finite duration")
    return total


@dataclass
class ScaleConfig:
    """`gptrun scale`'s miniseries (`experiments.scale`): `budgets` training budgets in FLOPs,
    a geometric series from `min_flops` to `max_flops`, and at each budget one run per width in
    `widths` (d_model, at the config's depth and head size), each trained for the budget's
    tokens at its size. Checked when `gptrun scale` reads it: other commands ignore it."""

    min_flops: float = 0.0
    max_flops: float = 0.0
    budgets: int = 3
    widths: list[int] = field(default_factory=list)


@dataclass
class RayExperiment(ExperimentConfig):
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)

    def to_dict(self) -> dict[str, Any]:
        """As gptcore saves a config, without an unset `[scale]`: a sweep's best.toml or a
        trial's checkpoint has no series to describe."""
        raw = super().to_dict()
        if self.scale == ScaleConfig():
            del raw["scale"]
        return raw


def load_experiment(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> RayExperiment:
    """An experiment TOML with every section, `--set` overrides applied, and the passwords of
    its URLs moved to the environment (`experiments.credentials`)."""
    from experiments.credentials import without_passwords

    return without_passwords(load_config(path, overrides, cls=RayExperiment))


def experiment_from_dict(raw: dict[str, Any]) -> RayExperiment:
    return config_from_dict(raw, RayExperiment)


def checked_for_workers(cfg: RayExperiment) -> RayExperiment:
    """Check the data and `train.init_from` in the driver (a bad input would otherwise fail every
    worker restart, or every trial) and make their paths absolute, since workers do not share the
    driver's working directory. `gptrun train` on Ray and `gptrun sweep` / `resume` call it
    before Ray starts."""
    from gptcore.checkpoint import load_checkpoint
    from gptcore.train import open_data

    open_data(cfg)
    cfg = with_absolute_paths(cfg)
    if cfg.train.init_from:
        load_checkpoint(cfg.train.init_from)  # exists and is intact
    return cfg


def with_absolute_paths(cfg: RayExperiment) -> RayExperiment:
    """`cfg` with `data.dir` and `train.init_from` absolute, so that it trains from any folder:
    on a worker, and from a config gptrun writes for the user (best.toml holds the sweep's
    config, which went through `checked_for_workers`; transfer's). Nothing is checked here: a
    target's data may live on the cluster only."""
    raw = cfg.to_dict()
    raw["data"]["dir"] = _absolute(cfg.data.dir)
    if cfg.train.init_from:
        raw["train"]["init_from"] = _absolute(cfg.train.init_from)
    return experiment_from_dict(raw)


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())
