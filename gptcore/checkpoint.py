"""Checkpoints: one `.pt` file that holds everything needed to resume a run bit for bit.

Contents: fp32 model weights, optimizer state, step and data position, tokens seen, guard state,
RNG states, the full config and the tokenizer hash. Everything is a tensor or a plain Python value
so that `torch.load(weights_only=True)` can read it. A sha256 over the model and optimizer tensors
catches silent corruption; a truncated file fails to unzip and is reported as such.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from gptcore.atomic import atomic_file
from gptcore.errors import UserError

FORMAT = "gptrun-checkpoint-v1"
CHECKPOINT_FILE = "checkpoint.pt"  # the file name inside a checkpoint folder (Ray Train)


def tensors_sha256(state: dict[str, Any]) -> str:
    """A digest over every tensor in the model and optimizer state, in a fixed order."""
    digest = hashlib.sha256()

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{prefix}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}/{i}", item)

    visit("model", state["model"])
    visit("optimizer", state["optimizer"])
    return digest.hexdigest()


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` atomically (temp file + rename) with its format tag and checksum."""
    path = Path(path)
    payload = {**state, "format": FORMAT, "sha256": tensors_sha256(state)}
    with atomic_file(path) as tmp:
        torch.save(payload, tmp)
    return path


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """Accept a checkpoint file, or a folder holding `checkpoint.pt` (Ray Train's layout)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist; pass a .pt file written by gptrun train")
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str = "cpu") -> dict[str, Any]:
    """Load and verify a checkpoint; any damage is a `UserError` that names the file."""
    path = resolve_checkpoint_path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise UserError(f"checkpoint {path} is corrupt or truncated ({type(err).__name__}); "
                        "use an earlier checkpoint or retrain") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a gptrun checkpoint (format tag missing)")
    if tensors_sha256(state) != state.get("sha256"):
        raise UserError(f"checkpoint {path} failed its checksum (the file is damaged); "
                        "use an earlier checkpoint or retrain")
    return state
