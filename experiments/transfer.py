"""`gptrun transfer SWEEP --to TARGET.toml`: a µP sweep's best trial, run on a narrow proxy, as a
training config for the wide target.

Under µP (`model.mup_base_width`, see gptcore.mup) the optimizer's values are those of the base
width at every width, so the proxy's best lr, weight decay and warmup (and any other optimizer key
the sweep searched), its base width and its output multiplier are copied into the target
unchanged; the model applies lr / m to its hidden matrices. µP transfers across width only, so
everything else that shapes the optimum must be the same in both: depth, d_head, vocabulary and
tokenizer, sequence length, batch, schedule. A difference is refused in one line rather than
transferred into a learning rate that no longer applies.

The token horizon is the exception the user may opt into: a longer run generally wants a lower
lr, and `--horizon-exponent a` multiplies the lr by (target tokens / proxy tokens)^-a. That is an
empirical rule (exponents near 0.3 are reported for AdamW), not part of µP; 0, the default,
leaves it off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.experiment import load_base
from experiments.outcome import best_trial
from experiments.ray_config import RayExperiment, load_experiment, with_absolute_paths
from experiments.results import best_config, fmt_value, load_trials
from experiments.sizing import trial_tokens
from experiments.space import Space, apply_overrides, config_value, parse_space
from experiments.table import print_columns
from gptcore.atomic import check_writable_dir, write_text_atomic
from gptcore.config import run_length
from gptcore.errors import UserError

CARRIED = ("optim.lr", "optim.weight_decay", "optim.warmup")  # always copied from the proxy
# Keys that must be equal on proxy and target (an optim key the sweep searched is carried instead).
SAME_MODEL = ("style", "n_layer", "vocab_size", "seq_len", "dropout", "rope_theta", "norm_eps")
SAME_OPTIM = (
    "schedule",
    "min_lr_ratio",
    "decay_fraction",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "decay_embeddings",
)
D_FF_TOLERANCE = 0.1  # d_ff / d_model may differ this much (llama's derived d_ff rounds to 64)


def transfer_cli(
    sweep: str, target: str, out: str | None, horizon_exponent: float, force: bool = False
) -> int:
    """Check, build and write the target's config; print proxy and target side by side."""
    exp_dir = Path(sweep)
    base, _ = load_base(exp_dir)  # UserError for a folder that is not a sweep
    if not base.model.mup_base_width:
        raise UserError(
            f"sweep {exp_dir} did not use µP (model.mup_base_width is 0), so its learning rate is "
            f"only right at d_model={base.model.d_model}; sweep the proxy with "
            f"--set model.mup_base_width={base.model.d_model}"
        )
    if horizon_exponent < 0:
        raise UserError(f"--horizon-exponent={horizon_exponent} must be >= 0 (0 turns it off)")
    target_cfg = load_experiment(target)
    space = parse_space(base)
    best = best_trial(load_trials(exp_dir))
    if best is None:
        raise UserError(f"sweep {exp_dir} has no trial that finished without error yet; resume it first")
    proxy = best_config(base, space, best, exp_dir.name)
    check_transferable(proxy, target_cfg, space)
    proxy_tokens, target_tokens = trial_tokens(proxy), trial_tokens(target_cfg)
    horizon = (target_tokens / proxy_tokens) ** -horizon_exponent
    values = {key: config_value(proxy, key) for key in carried_keys(space)}
    values["optim.lr"] = proxy.optim.lr * horizon
    values["model.mup_base_width"] = proxy.model.mup_base_width
    values["model.mup_output_mult"] = proxy.model.mup_output_mult
    # Paths absolute, as in best.toml: the printed `gptrun train OUT` then works from any folder.
    result = with_absolute_paths(apply_overrides(target_cfg, values))
    out_path = Path(out) if out else exp_dir / f"transfer-{Path(target).stem}.toml"
    check_out_file(out_path, force)
    _print_side_by_side(proxy, result, best, proxy_tokens, target_tokens, horizon, horizon_exponent, space)
    write_text_atomic(out_path, result.to_toml())
    print(f"wrote {out_path}; train it: gptrun train {out_path}")
    return 0


def check_out_file(path: Path, force: bool) -> None:
    """Refuse, before anything is printed or written, an --out that is a folder, an existing file
    (without --force) or a path in a folder that cannot be written."""
    if path.is_dir():
        raise UserError(f"--out {path} is a folder; give a .toml file name")
    if path.exists() and not force:
        raise UserError(f"--out {path} exists; pass --force to replace it, or give a new file name")
    check_writable_dir(path.parent, "--out's folder")


def carried_keys(space: Space) -> list[str]:
    """lr, weight decay, warmup, and every other optimizer key the sweep searched or fixed."""
    searched = [key for key in (*space.keys, *space.fixed) if key.startswith("optim.")]
    return list(dict.fromkeys([*CARRIED, *searched]))


def check_transferable(proxy: RayExperiment, target: RayExperiment, space: Space) -> None:
    """Refuse a target that differs from the proxy in anything µP does not transfer."""
    p, t = proxy.model, target.model
    diffs = [
        f"model.{k}: {getattr(p, k)} vs {getattr(t, k)}" for k in SAME_MODEL if getattr(p, k) != getattr(t, k)
    ]
    if p.d_model // p.n_head != t.d_model // t.n_head:
        diffs.append(
            f"d_head (d_model / n_head): {p.d_model // p.n_head} vs {t.d_model // t.n_head}; "
            f"give the target n_head = {t.d_model // (p.d_model // p.n_head)}"
        )
    if p.n_head // p.n_kv_head != t.n_head // t.n_kv_head:
        diffs.append(f"query heads per KV head: {p.n_head // p.n_kv_head} vs {t.n_head // t.n_kv_head}")
    ratio_p, ratio_t = p.d_ff / p.d_model, t.d_ff / t.d_model
    if abs(ratio_t / ratio_p - 1) > D_FF_TOLERANCE:
        diffs.append(f"d_ff / d_model: {ratio_p:.3g} vs {ratio_t:.3g}")
    carried = set(carried_keys(space))
    for key in SAME_OPTIM:
        if f"optim.{key}" not in carried and getattr(proxy.optim, key) != getattr(target.optim, key):
            diffs.append(f"optim.{key}: {getattr(proxy.optim, key)} vs {getattr(target.optim, key)}")
    if _tokens_per_step(proxy) != _tokens_per_step(target):
        diffs.append(
            f"tokens per step (batch_size x grad_accum x seq_len x workers): "
            f"{_tokens_per_step(proxy)} vs {_tokens_per_step(target)}"
        )
    if proxy.train.stage != target.train.stage:
        diffs.append(f"train.stage: {proxy.train.stage} vs {target.train.stage}")
    if t.mup_base_width not in (0, p.mup_base_width):
        diffs.append(f"model.mup_base_width: {p.mup_base_width} vs {t.mup_base_width}")
    proxy_tok, target_tok = _tokenizer_hash(proxy), _tokenizer_hash(target)
    if proxy_tok and target_tok and proxy_tok != target_tok:
        diffs.append(f"tokenizer: the data folders {proxy.data.dir} and {target.data.dir} use different ones")
    if diffs:
        raise UserError(
            "proxy (the sweep's best trial) and target differ in what µP does not transfer: "
            + "; ".join(diffs)
            + "; make the target match the proxy there (µP transfers across width only)"
        )


def _print_side_by_side(
    proxy: RayExperiment,
    target: RayExperiment,
    best: dict[str, Any],
    proxy_tokens: int,
    target_tokens: int,
    horizon: float,
    exponent: float,
    space: Space,
) -> None:
    rows = [
        ["model.d_model", str(proxy.model.d_model), str(target.model.d_model)],
        ["model.n_head", str(proxy.model.n_head), str(target.model.n_head)],
        ["model.d_ff", str(proxy.model.d_ff), str(target.model.d_ff)],
        ["model.mup_base_width", str(proxy.model.mup_base_width), str(target.model.mup_base_width)],
        [
            "model.mup_output_mult",
            fmt_value(proxy.model.mup_output_mult),
            fmt_value(target.model.mup_output_mult),
        ],
        ["width multiplier m", fmt_value(proxy.model.width_mult), fmt_value(target.model.width_mult)],
        *[
            [key, fmt_value(config_value(proxy, key)), fmt_value(config_value(target, key))]
            for key in carried_keys(space)
        ],
        [
            "hidden-matrix lr (lr / m)",
            fmt_value(proxy.optim.lr / proxy.model.width_mult),
            fmt_value(target.optim.lr / target.model.width_mult),
        ],
        ["tokens", f"{proxy_tokens:,}", f"{target_tokens:,}"],
    ]
    print_columns(["", f"proxy (trial {best['trial_id']})", "target"], rows)
    print(f"proxy val loss {best['val_loss']:.4f}")
    if exponent:
        print(
            f"token horizon: lr x ({target_tokens:,} / {proxy_tokens:,})^-{exponent:g} = x{horizon:.3g} "
            "(an empirical rule, not part of µP)"
        )


def _tokens_per_step(cfg: RayExperiment) -> int:
    return run_length(cfg, cfg.resources.workers).tokens_per_step


def _tokenizer_hash(cfg: RayExperiment) -> str:
    """The tokenizer hash of the config's data folder, or "" where it cannot be read (a target
    whose data lives on the cluster): then only the vocabulary size is compared."""
    try:
        return json.loads((Path(cfg.data.dir) / "meta.json").read_text())["tokenizer_sha256"]
    except (OSError, ValueError, KeyError):
        return ""
