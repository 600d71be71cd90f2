"""LoRA (Hu et al., 2021): train low-rank adapters beside frozen linears; merge them for export.

A targeted linear computes `W x + (alpha / rank) * B (A x)`. A (rank x in) starts Kaiming-uniform
and B (out x rank) at zero, so step 0 is exactly the base model. Only A and B train, so the
optimizer state and the checkpoints hold the adapters alone; a checkpoint names its base (path
and the hash of its weights), and `model_from_state` rebuilds the base, adds the adapters and
merges them into plain linears, which is what `gptrun sample` and `gptrun export` use.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gptcore.checkpoint import load_checkpoint, resolve_checkpoint_path
from gptcore.config import LoraConfig, model_world_config
from gptcore.errors import UserError
from gptcore.model import GPT


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def merged(self) -> nn.Linear:
        """The base linear with the update folded into its weight."""
        with torch.no_grad():
            self.base.weight += (self.lora_B @ self.lora_A) * self.scale
        return self.base


def add_lora(model: GPT, cfg: LoraConfig) -> str:
    """Freeze `model` and wrap the linears `cfg.targets` names in every block; return a one-line
    summary with the trainable fraction. A target that matches no linear is refused."""
    for p in model.parameters():
        p.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    matched: dict[str, int] = dict.fromkeys(cfg.targets, 0)
    linears: set[str] = set()
    for block in model.blocks:
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            linears.add(name)
            hits = [t for t in cfg.targets if name == t or name.startswith(t + ".")]
            for t in hits:
                matched[t] += 1
            if hits:
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent), leaf, LoRALinear(module, cfg.rank, cfg.alpha))
    unmatched = [t for t, n in matched.items() if not n]
    if unmatched:
        raise UserError(
            f"lora.targets {unmatched} match no linear of a {model.cfg.style} block; "
            f'its linears are {", ".join(sorted(linears))} (or "attn" / "mlp" for all of a part)'
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped = sum(isinstance(m, LoRALinear) for m in model.modules())
    return (
        f"LoRA rank {cfg.rank}, alpha {cfg.alpha:g} on {wrapped} linears: {trainable:,} trainable "
        f"parameters, {100 * trainable / total:.2f}% of the model's {total:,}"
    )


def merge_lora(model: GPT) -> GPT:
    """Fold every adapter into its linear, in place: a plain GPT, all parameters trainable."""
    for block in model.blocks:
        for name, module in list(block.named_modules()):
            if isinstance(module, LoRALinear):
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent), leaf, module.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """The adapters of a LoRA model, as fp32 CPU tensors (what a LoRA checkpoint stores)."""
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items() if ".lora_" in k}


def load_adapters(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load a LoRA checkpoint's adapters into a model whose base weights are already in place."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected:
        raise UserError(
            f"LoRA adapters do not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "use the checkpoint's own [lora] settings"
        )


def weights_sha256(weights: dict[str, Tensor]) -> str:
    """sha256 of a model's weights (names and fp32 values): what a LoRA checkpoint's base must
    hold. Weights rather than file bytes, so a base checkpoint saved again unchanged still fits."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode() + b"\0")
        digest.update(weights[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def base_record(path: str | Path, weights: dict[str, Tensor]) -> dict[str, str]:
    """How a LoRA checkpoint names its base: the checkpoint's absolute path and its weights' hash."""
    return {"path": str(resolve_checkpoint_path(path).resolve()), "weights_sha256": weights_sha256(weights)}


def load_base(record: dict[str, str]) -> dict[str, Tensor]:
    """The weights of the base a LoRA checkpoint names, checked to be the ones it was trained on."""
    path = Path(record["path"])
    if not path.is_file():
        raise UserError(f"this LoRA checkpoint needs its base checkpoint {path}, which is missing")
    weights = model_from_state(load_checkpoint(path)).state_dict()
    if weights_sha256(weights) != record["weights_sha256"]:
        raise UserError(
            f"base checkpoint {path} holds other weights than the ones the LoRA adapters were trained on; "
            "restore that checkpoint or retrain the adapters"
        )
    return weights


def model_from_state(state: dict[str, Any]) -> GPT:
    """The plain GPT a checkpoint holds: its weights, or for a LoRA checkpoint its base's weights
    with the adapters merged in."""
    cfg = model_world_config(state["config"])
    model = GPT(cfg.model)
    if "lora_base" not in state:
        model.load_state_dict(state["model"])
        return model
    model.load_state_dict(load_base(state["lora_base"]))
    add_lora(model, cfg.lora)
    load_adapters(model, state["model"])
    return merge_lora(model)
