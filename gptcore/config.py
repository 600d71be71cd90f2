"""Experiment configuration: TOML sections loaded into dataclasses, with `--set a.b=v` overrides.

Every key is checked: an unknown section or key, or a value of the wrong type, raises `UserError`
with a message that names the key and suggests the closest valid one. A model `preset` fills in the
model keys it names; keys given explicitly in the file win over the preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import tomllib
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import tomli_w

from gptcore.data import VOCAB_LIMIT
from gptcore.device import check_device_name
from gptcore.errors import UserError

# Model presets. `minimind-26m` is the MiniMind recipe (llama blocks, GQA with 2 KV heads; its
# d_ff 1408 is the derived 8/3 x 512 rounded up to 64); `gpt2-124m` is GPT-2 small, but with the
# project's 6400-token byte-level BPE by default. A preset names no derived key (DERIVED_KEYS) it
# does not mean to fix, so that `--set model.n_head=8` on a preset stays plain attention.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(style="gpt2", n_layer=2, n_head=2, d_model=64, seq_len=64),
    "quickstart": dict(style="gpt2", n_layer=4, n_head=4, d_model=128, seq_len=128),
    "minimind-26m": dict(
        style="llama", n_layer=8, n_head=8, n_kv_head=2, d_model=512, seq_len=512, vocab_size=6400
    ),
    "gpt2-124m": dict(style="gpt2", n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=6400),
}
# Model keys whose 0 means "derived from other keys" (see ModelConfig). A config saves them only
# when the user set them, so a saved config loaded with another d_model / n_head / seq_len (a
# sweep over width, `--set` on best.toml, `gptrun transfer`) derives them again.
DERIVED_KEYS = ("n_kv_head", "d_ff", "max_positions")


# The [model] keys that fix the weights' shapes: a checkpoint loads only into the same ones.
SHAPE_KEYS = ("style", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_positions", "vocab_size")
PRECISIONS = ("auto", "fp32", "bf16")  # train.precision
STAGES = ("pretrain", "sft")  # train.stage


@dataclass
class ModelConfig:
    preset: str = ""
    style: str = "gpt2"  # "gpt2" (learned positions, LayerNorm, GELU) | "llama" (RoPE, RMSNorm, SwiGLU)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0  # 0 means n_head (plain multi-head attention)
    d_model: int = 128
    d_ff: int = 0  # 0 means 4*d_model (gpt2) or MiniMind's 8/3*d_model rounded up to 64 (llama)
    seq_len: int = 128
    max_positions: int = 0  # learned-position table size for gpt2 / RoPE limit; 0 means seq_len
    vocab_size: int = 6400
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # µP (gptcore.mup): the d_model whose learning rate and init this config's values are; 0 = off.
    mup_base_width: int = 0
    mup_output_mult: float = 1.0  # µP: the logits' multiplier at the base width (then / m)

    def __post_init__(self) -> None:
        self._derived = tuple(key for key in DERIVED_KEYS if getattr(self, key) == 0)
        self._from_preset: tuple[str, ...] = ()  # set by config_from_dict
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.max_positions == 0:
            self.max_positions = self.seq_len
        if self.d_ff == 0:
            self.d_ff = (
                4 * self.d_model if self.style == "gpt2" else 64 * ((int(self.d_model * 8 / 3) + 63) // 64)
            )

    @property
    def width_mult(self) -> float:
        """µP's width multiplier m = d_model / mup_base_width (1.0 with µP off)."""
        return self.d_model / self.mup_base_width if self.mup_base_width else 1.0

    def derives(self, key: str) -> bool:
        """Whether derived key `key` was left to be derived (set neither by the user nor a preset)."""
        return key in self._derived

    def to_dict(self) -> dict[str, Any]:
        """What a saved config holds: the keys the user set. Derived keys left to be derived and
        keys the preset filled in are left out, so that loading it derives them again."""
        skip = {*self._derived, *self._from_preset}
        return {key: value for key, value in asdict(self).items() if key not in skip}

    def validate(self) -> None:
        require_choice("model.style", self.style, ("gpt2", "llama"))
        for key in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "seq_len", "vocab_size"):
            require_positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_head:
            raise UserError(
                f"model.d_model={self.d_model} is not divisible by model.n_head="
                f"{self.n_head}; pick a d_model that is a multiple of n_head"
            )
        if self.n_head % self.n_kv_head:
            raise UserError(
                f"model.n_head={self.n_head} is not a multiple of model.n_kv_head="
                f"{self.n_kv_head}; grouped-query attention needs n_head % n_kv_head == 0"
            )
        if self.seq_len > self.max_positions:
            raise UserError(
                f"model.seq_len={self.seq_len} is larger than the model's positions "
                f"(model.max_positions={self.max_positions}); lower seq_len or raise "
                "max_positions"
            )
        if self.vocab_size > VOCAB_LIMIT:
            raise UserError(
                f"model.vocab_size={self.vocab_size} does not fit uint16 token shards (at most {VOCAB_LIMIT})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.mup_base_width < 0:
            raise UserError(f"model.mup_base_width={self.mup_base_width} must be >= 0 (0 turns µP off)")
        require_positive("model.mup_output_mult", self.mup_output_mult)
        if self.mup_output_mult != 1.0 and not self.mup_base_width:
            raise UserError(
                f"model.mup_output_mult={self.mup_output_mult} is µP's and needs model.mup_base_width "
                "(the width it applies at); set both, or leave mup_output_mult at 1"
            )


@dataclass
class DataConfig:
    dir: str = "data/shakespeare"


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup: float = 0.05  # >= 1: steps; < 1: fraction of the run
    schedule: str = "cosine"  # "cosine" | "wsd" | "constant"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the last fraction of the run decays linearly to the floor
    grad_clip: float = 1.0  # 0 turns clipping off
    decay_embeddings: bool = True

    def validate(self) -> None:
        if not self.lr > 0:
            raise UserError(f"optim.lr={self.lr} must be > 0")
        if self.weight_decay < 0:
            raise UserError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise UserError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        if not self.eps > 0:
            raise UserError(f"optim.eps={self.eps} must be > 0")
        if self.warmup < 0:
            raise UserError(f"optim.warmup={self.warmup} must be >= 0 (steps, or a fraction < 1)")
        require_choice("optim.schedule", self.schedule, ("cosine", "wsd", "constant"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise UserError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.grad_clip < 0:
            raise UserError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")


@dataclass
class TrainConfig:
    batch_size: int = 16  # micro-batch per worker
    grad_accum: int = 1
    max_steps: int = 1000
    max_tokens: int = 0  # when > 0, the run stops at this many tokens (max_steps is then unused)
    eval_interval: int = 100
    eval_tokens: int = 65536
    log_interval: int = 10
    checkpoint_interval: int = 0  # 0 means every eval
    keep_checkpoints: int = 3  # Ray Train keeps this many (0 keeps all)
    seed: int = 1337
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N" | "mps"
    # "auto" | "fp32" | "bf16": bf16 autocast of forward + loss over fp32 weights and optimizer
    # state; auto is bf16 on a GPU with bf16 and on a CPU whose bf16 matmul is >= 1.5x its fp32.
    precision: str = "auto"
    # "auto" | true | false: torch.compile the model; auto when the run is long enough to repay
    # the compile (gptcore.autocompile)
    compile: bool | str = "auto"
    out: str = "runs/quickstart"
    max_bad_steps: int = 5  # consecutive NaN/inf steps before a rollback
    max_rollbacks: int = 3  # rollbacks before the run stops as diverged
    num_threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    extend: bool = False  # a resume may change the run's length (the lr schedule follows)
    # "pretrain" (documents) | "sft" (conversations from `gptrun prepare --sft`: loss on assistant turns)
    stage: str = "pretrain"
    init_from: str = ""  # a checkpoint whose weights start the run (same shape and tokenizer), e.g. for SFT

    def validate(self) -> None:
        for key in (
            "batch_size",
            "grad_accum",
            "eval_interval",
            "eval_tokens",
            "log_interval",
            "max_bad_steps",
        ):
            require_positive(f"train.{key}", getattr(self, key))
        if self.max_steps <= 0 and self.max_tokens <= 0:
            raise UserError("train.max_steps and train.max_tokens are both 0; set one of them")
        for key in ("checkpoint_interval", "keep_checkpoints", "max_rollbacks", "num_threads", "max_tokens"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key}={getattr(self, key)} must be >= 0")
        if self.checkpoint_interval % self.eval_interval:
            raise UserError(
                f"train.checkpoint_interval={self.checkpoint_interval} must be a "
                f"multiple of train.eval_interval={self.eval_interval} (checkpoints "
                "are taken at evaluations)"
            )
        check_device_name(self.device, "train.device")
        require_choice("train.precision", self.precision, PRECISIONS)
        require_choice("train.stage", self.stage, STAGES)
        if self.compile not in (True, False, "auto"):
            raise UserError(
                f'train.compile={self.compile!r} must be "auto", true or false (true and false unquoted)'
            )


@dataclass
class LoraConfig:
    """LoRA: low-rank adapters on frozen weights (rank > 0 turns it on; the recipe uses 8 and 16).

    `targets` name linears inside each block: "attn" / "mlp" take all of that part's linears,
    "attn.qkv", "attn.proj", "mlp.fc", "mlp.proj", "mlp.gate", "mlp.up" one each."""

    rank: int = 0
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: ["attn", "mlp"])

    def validate(self) -> None:
        if self.rank < 0:
            raise UserError(f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        require_positive("lora.alpha", self.alpha)
        if not self.targets:
            raise UserError('lora.targets is empty; name linears to adapt, e.g. ["attn", "mlp"]')


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> ExperimentConfig:
        for section in fields(self):
            check = getattr(getattr(self, section.name), "validate", None)
            if check is not None:
                check()
        if self.lora.rank and not self.train.init_from:
            raise UserError(
                "lora.rank > 0 needs train.init_from: the checkpoint whose frozen weights the adapters adapt"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model": self.model.to_dict()}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


@dataclass(frozen=True)
class RunLength:
    """How long a run is: the one place that turns `[train]` into steps and tokens, used by the
    trainer, sweeps, `gptrun plan` and the results reader alike."""

    tokens_per_step: int  # batch_size x seq_len x grad_accum x world_size
    total_steps: int

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.total_steps


def run_length(cfg: ExperimentConfig, world_size: int = 1) -> RunLength:
    """`train.max_tokens` (rounded up to whole steps) when set, else `train.max_steps`."""
    t = cfg.train
    per_step = t.batch_size * cfg.model.seq_len * t.grad_accum * world_size
    steps = math.ceil(t.max_tokens / per_step) if t.max_tokens else t.max_steps
    return RunLength(per_step, steps)


def run_length_line(cfg: ExperimentConfig, world_size: int = 1) -> str:
    """The run's length and the key that sets it, for a run's first log line: a file that sets
    `train.max_tokens` keeps `train.max_steps` (its default, at least), which is then unused."""
    t, length = cfg.train, run_length(cfg, world_size)
    size = f"run length: {length.total_steps:,} steps of {length.tokens_per_step:,} tokens"
    if t.max_tokens:
        return f"{size} (train.max_tokens={t.max_tokens:,}; train.max_steps is unused)"
    return f"{size} (train.max_steps)"


def sections(cls: type[ExperimentConfig] = ExperimentConfig) -> list[str]:
    """The TOML tables of a config class: gptcore's own, plus any a subclass adds."""
    return [f.name for f in fields(cls) if f.name != "name"]


SECTIONS = sections()
C = TypeVar("C", bound=ExperimentConfig)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
    cls: type[C] = ExperimentConfig,
) -> C:
    """Read a TOML experiment (or start from `base`, a dict from `to_dict`), apply `--set`s.
    `cls` is the config class: experiments passes one with its Ray sections added."""
    raw: dict[str, Any] = {}
    if base is not None:
        raw = _deep_copy(base)
    if path is not None:
        raw = _read_toml(Path(path))
    given = [_apply_override(raw, item, sections(cls)) for item in overrides]
    _one_run_length(raw, given, f"{path}" if path is not None else "the base config")
    return config_from_dict(raw, cls)


RUN_LENGTH_KEYS = ("max_steps", "max_tokens")  # [train]: two ways to say how long a run is


def _one_run_length(raw: dict[str, Any], given: list[str], origin: str) -> None:
    """Make a `--set` of `train.max_steps` or `train.max_tokens` the run's length: it clears the
    other key of the file, which would otherwise win (max_tokens) or be ignored. A cleared key is
    said on stdout, and the run's first log line (`run_length_line`) names the key in force. Setting
    a key to 0 clears nothing; both set to a length on the command line is refused."""
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    lengths = [k for k in RUN_LENGTH_KEYS if f"train.{k}" in given and _is_length(train.get(k))]
    if len(lengths) == 2:
        raise UserError(
            "--set gives both train.max_steps and train.max_tokens; they are two ways to say the "
            "run's length: set one"
        )
    if not lengths:
        return
    (key,) = lengths
    other = next(k for k in RUN_LENGTH_KEYS if k != key)
    if f"train.{other}" in given or not _is_length(train.get(other)):
        return
    print(f"run length: --set train.{key}={train[key]} clears train.{other}={train[other]} (set in {origin})")
    train[other] = 0


def _is_length(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def config_from_dict(raw: dict[str, Any], cls: type[C] = ExperimentConfig) -> C:
    raw = _deep_copy(raw)
    known = sections(cls)
    for key in raw:
        if key not in known and key != "name":
            raise UserError(f"unknown config section [{key}]{_did_you_mean(key, [*known, 'name'])}")
    model_raw = raw.get("model", {})
    from_preset: list[str] = []
    preset = model_raw.get("preset", "") if isinstance(model_raw, dict) else ""
    if preset:
        if preset not in PRESETS:
            raise UserError(f"unknown model.preset {preset!r}; known presets: {', '.join(PRESETS)}")
        from_preset = [key for key in PRESETS[preset] if key not in model_raw]
        raw["model"] = {**PRESETS[preset], **model_raw}
    name = raw.get("name", "experiment")
    if not isinstance(name, str):
        raise UserError(f"name={name!r} must be a string")
    types = get_type_hints(cls)
    built = {key: _build_section(key, types[key], raw.get(key, {})) for key in known}
    built["model"]._from_preset = tuple(from_preset)
    return cls(name=name, **built).validate()


def model_world_config(raw: dict[str, Any]) -> ExperimentConfig:
    """gptcore's sections of a saved config. A checkpoint written by a sweep trial also carries
    the Ray side's tables ([resources], [sweep], ...), which the model world does not read."""
    return config_from_dict({k: v for k, v in raw.items() if k == "name" or k in SECTIONS})


def _build_section(section: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise UserError(f"[{section}] must be a table of keys, got {values!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise UserError(f"unknown config key {section}.{key}{_did_you_mean(key, names, section)}")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    return cls(**kwargs)


def _coerce(key: str, want: Any, value: Any) -> Any:
    if want is bool:
        if isinstance(value, bool):
            return value
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif want is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML's inf and nan: no key means them
                raise UserError(f"config key {key}={value} must be a finite number")
            return float(value)
    elif want is str:
        if isinstance(value, str):
            return value
    elif isinstance(want, types.UnionType):  # bool | str: the first type that takes the value
        for arm in get_args(want):
            with contextlib.suppress(UserError):
                return _coerce(key, arm, value)
    elif get_origin(want) is list:  # list[str], list[int]
        (item,) = get_args(want)
        if isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            return value
        words = {str: "strings", int: "integers"}[item]
        raise UserError(f"config key {key} must be a list of {words}, got {value!r}")
    elif isinstance(value, dict):  # dict[str, Any]
        return value
    arms = get_args(want) if isinstance(want, types.UnionType) else (want,)
    type_name = " or ".join(getattr(arm, "__name__", str(arm)) for arm in arms)
    raise UserError(f"config key {key} must be a {type_name}, got {value!r}")


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise UserError(f"config file {path} does not exist")
    if path.is_dir():
        raise UserError(f"config path {path} is a folder; give a .toml file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"config file {path} is not valid TOML: {err}") from None


def _apply_override(raw: dict[str, Any], item: str, known: list[str]) -> str:
    """Set one `section.key=value` in `raw`; returns the key."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare word is a string: --set train.device=cpu
    *path, leaf = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {key}: {part} is not a section")
    if not path and leaf != "name":
        raise UserError(f"--set {key}: give section.key, e.g. optim.{leaf}{_did_you_mean(leaf, known)}")
    node[leaf] = value
    return key


def _did_you_mean(word: str, options: list[str], section: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if not close:
        return f" (valid: {', '.join(options)})"
    return f"; did you mean {section + '.' if section else ''}{close[0]}?"


def require_positive(key: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{key}={value} must be > 0")


def require_choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise UserError(
            f"{key}={value!r} is not one of {', '.join(options)}{_did_you_mean(value, list(options))}"
        )


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return tomllib.loads(tomli_w.dumps(raw))
