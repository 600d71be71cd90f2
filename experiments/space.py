"""The `[sweep.space]` table: which config keys a sweep searches, and over what.

    [sweep.space]
    lr = { loguniform = [3e-4, 3e-2] }
    weight_decay = { loguniform = [1e-3, 0.3], include_zero = true }
    warmup = { uniform = [0.0, 0.3] }
    "train.batch_size" = { choice = [8, 16, 32] }
    beta2 = 0.99                       # a plain value fixes the key instead of searching it

Short names (`lr`, `weight_decay`, `warmup`, `beta1`, `beta2`, `eps`, `batch_size`, ...) stand for
their config keys. Sampling is define-by-run Optuna, so `include_zero` is a real conditional
choice (TPE learns whether 0 is better) rather than a fudge on the log scale.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from experiments.ray_config import RayExperiment, experiment_from_dict
from gptcore.errors import UserError

ALIASES = {
    name: f"optim.{name}"
    for name in ("lr", "weight_decay", "warmup", "beta1", "beta2", "eps", "min_lr_ratio", "grad_clip")
}
ALIASES.update(batch_size="train.batch_size", grad_accum="train.grad_accum")
KINDS = ("loguniform", "uniform", "int", "choice")
ZERO_SUFFIX = "_is_zero"  # `optim.weight_decay_is_zero`: the include_zero choice (a valid MLflow key)


@dataclass(frozen=True)
class Param:
    key: str  # full config key, e.g. "optim.lr"
    kind: str  # one of KINDS
    low: float = 0.0
    high: float = 0.0
    choices: tuple = ()
    include_zero: bool = False

    @property
    def zero_flag(self) -> str:
        return self.key + ZERO_SUFFIX


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    fixed: dict[str, Any]

    @property
    def keys(self) -> tuple[str, ...]:
        """The searched config keys: the columns of Tune's progress table."""
        return tuple(p.key for p in self.params)

    @property
    def conditional(self) -> bool:
        """Whether some trials ask for a key that others do not (a zero chosen skips its value)."""
        return any(p.include_zero for p in self.params)

    def record(self) -> dict[str, Any]:
        """The space as JSON data: what a sweep's study records, and what a warm start compares."""
        params = {
            p.key: {
                "kind": p.kind,
                "low": p.low,
                "high": p.high,
                "choices": list(p.choices),
                "include_zero": p.include_zero,
            }
            for p in self.params
        }
        return json.loads(json.dumps({"params": params, "fixed": self.fixed}))

    def suggest(self, trial: Any) -> dict[str, float]:
        """Optuna define-by-run: ask `trial` for every searched key. A key whose zero was chosen
        is returned as a constant 0.0, so that every trial's config holds every searched key
        (Tune's progress table looks each one up)."""
        zeros: dict[str, float] = {}
        for p in self.params:
            if p.include_zero and trial.suggest_categorical(p.zero_flag, [False, True]):
                zeros[p.key] = 0.0
                continue
            if p.kind in ("loguniform", "uniform"):
                trial.suggest_float(p.key, p.low, p.high, log=p.kind == "loguniform")
            elif p.kind == "int":
                trial.suggest_int(p.key, int(p.low), int(p.high))
            else:
                trial.suggest_categorical(p.key, list(p.choices))
        return zeros

    def baseline(self, cfg: RayExperiment) -> dict[str, Any]:
        """The config's own values as an Optuna point: the trial every sweep should beat."""
        point: dict[str, Any] = {}
        for p in self.params:
            value = config_value(cfg, p.key)
            if p.include_zero:
                point[p.zero_flag] = value == 0
                if value == 0:
                    continue
            inside = value in p.choices if p.kind == "choice" else p.low <= value <= p.high
            if not inside:
                raise UserError(
                    f"{p.key}={value} (the baseline trial) lies outside its "
                    f"sweep.space range; widen the range, change {p.key}, or set "
                    "sweep.baseline = false"
                )
            point[p.key] = value
        return point

    def overrides(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """Config values for one trial: the fixed keys, the sampled ones, 0 where chosen."""
        values = dict(self.fixed)
        for p in self.params:
            if p.include_zero and sampled.get(p.zero_flag):
                values[p.key] = 0.0
            elif p.key in sampled:
                values[p.key] = sampled[p.key]
        return values


def parse_space(cfg: RayExperiment) -> Space:
    raw = cfg.sweep.space
    if not raw:
        raise UserError("[sweep.space] is empty; add e.g. lr = { loguniform = [1e-4, 1e-2] }")
    params, fixed = [], {}
    for name, spec in raw.items():
        key = ALIASES.get(name, name)
        current = config_value(cfg, key)  # raises for unknown keys
        if not isinstance(spec, dict):
            fixed[key] = spec
            continue
        params.append(_parse_param(key, spec, current))
    if not params:
        raise UserError("[sweep.space] fixes every key and searches none; give at least one range")
    space = Space(tuple(params), fixed)
    apply_overrides(cfg, space.overrides({}))  # fixed values must be valid config values
    _check_choices(cfg, space)
    _check_heads(cfg, space)
    return space


MAX_CHOICE_COMBINATIONS = 4096  # beyond this many, each choice value is checked on its own


def _check_choices(cfg: RayExperiment, space: Space) -> None:
    """Every combination of `choice` values must make a valid config, checked before any trial
    runs (a model key's choice can clash with another key: d_model with n_head)."""
    choices = [p for p in space.params if p.kind == "choice"]
    if not choices:
        return
    if math.prod(len(p.choices) for p in choices) <= MAX_CHOICE_COMBINATIONS:
        combos = itertools.product(*[[(p.key, v) for v in p.choices] for p in choices])
    else:
        combos = ([(p.key, v)] for p in choices for v in p.choices)
    for combo in combos:
        try:
            apply_overrides(cfg, space.overrides(dict(combo)))
        except UserError as err:
            shown = ", ".join(f"{k}={v!r}" for k, v in combo)
            raise UserError(f"sweep.space: the trial with {shown} is not a valid config: {err}") from None


def _check_heads(cfg: RayExperiment, space: Space) -> None:
    """A searched n_head beside an n_kv_head fixed at the base's n_head would turn the other
    trials into grouped-query attention without anyone asking for it."""
    keys = {p.key for p in space.params} | set(space.fixed)
    m = cfg.model
    fixed_kv = "model.n_kv_head" not in keys and not m.derives("n_kv_head")
    if "model.n_head" in keys and fixed_kv and m.n_kv_head == m.n_head:
        raise UserError(
            f"sweep.space searches model.n_head but model.n_kv_head = {m.n_kv_head} is set, so "
            "trials with more heads would be grouped-query attention; remove model.n_kv_head "
            "(it then follows n_head) or search it too"
        )


def _parse_param(key: str, spec: dict[str, Any], current: Any) -> Param:
    kinds = [k for k in spec if k in KINDS]
    extra = [k for k in spec if k not in (*KINDS, "include_zero")]
    if len(kinds) != 1 or extra:
        raise UserError(
            f"sweep.space.{key}: give exactly one of {', '.join(KINDS)} "
            f"(and optionally include_zero), got {sorted(spec)}"
        )
    kind, value = kinds[0], spec[kinds[0]]
    include_zero = bool(spec.get("include_zero", False))
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise UserError(f"sweep.space.{key}: choice needs a non-empty list of values")
        return Param(key, kind, choices=tuple(value))
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    ):
        raise UserError(f"sweep.space.{key}: {kind} needs [low, high] (finite numbers), got {value!r}")
    low, high = float(value[0]), float(value[1])
    if not low < high:
        raise UserError(
            f"sweep.space.{key}: the range [{value[0]}, {value[1]}] is empty; low must be below high"
        )
    if kind == "loguniform" and low <= 0:
        raise UserError(
            f"sweep.space.{key}: loguniform needs low > 0, got {value[0]}; use "
            "include_zero = true to also try 0"
        )
    if key == "optim.lr" and low <= 0:
        raise UserError(f"sweep.space.{key}: a learning rate must be > 0, got low={value[0]}")
    if isinstance(current, int) and not isinstance(current, bool) and kind != "int":
        raise UserError(f"sweep.space.{key}: {key} is an integer; use int = [low, high] or choice")
    if isinstance(current, (bool, str)):
        raise UserError(f"sweep.space.{key}: {key} is not numeric; use choice = [...]")
    return Param(key, kind, low, high, include_zero=include_zero)


def apply_overrides(cfg: RayExperiment, values: dict[str, Any]) -> RayExperiment:
    """A new, validated config with `section.key` values replaced."""
    raw = cfg.to_dict()
    for key, value in values.items():
        section, _, leaf = key.partition(".")
        raw[section][leaf] = value
    return experiment_from_dict(raw)


def config_value(cfg: RayExperiment, key: str) -> Any:
    """The value of `section.key` in `cfg`; a key that no sweep may search is refused."""
    section, _, leaf = key.partition(".")
    obj = getattr(cfg, section, None) if leaf else None
    if (
        obj is None
        or section == "sweep"
        or not dataclasses.is_dataclass(obj)
        or leaf not in {f.name for f in dataclasses.fields(obj)}
    ):
        known = ", ".join(ALIASES)
        raise UserError(
            f"sweep.space: {key!r} is not a config key that can be searched; use a "
            f"section.key such as optim.lr, or one of: {known}"
        )
    return getattr(obj, leaf)
