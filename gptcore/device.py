"""Device names (`train.device`, `gptrun sample --device`, the benchmarks' `--device`), checked in
one place: a name that is not a device, or a device this machine does not have (mps on Linux,
cuda:7 on a one-GPU node), is one line naming it and what is here, not a traceback from inside
torch at the first tensor moved.

The form is checked without torch, so that config validation stays torch-free; what exists is
checked when a name becomes a `torch.device`.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from gptcore.errors import UserError

if TYPE_CHECKING:
    import torch

DEVICE_NAMES = "auto, cpu, cuda, cuda:N, mps"


def check_device_name(name: str, option: str) -> None:
    """Refuse a string that names no device gptrun can run on; `option` is how the user set it."""
    if name not in ("auto", "cpu", "cuda", "mps") and not re.fullmatch(r"cuda:\d+", name):
        raise UserError(f"{option} {name!r} is not a device; use one of {DEVICE_NAMES}")


def available_devices() -> list[str]:
    """The devices torch can use on this machine: cpu, then each cuda:N, then mps."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """`name` as a torch device, refused in one line unless this machine has it. auto: cuda (the
    current GPU), else mps, else cpu."""
    import torch

    check_device_name(name, option)
    here = available_devices()
    if name == "auto":
        name = "cuda" if "cuda:0" in here else "mps" if "mps" in here else "cpu"
    elif not (name in here or (name == "cuda" and "cuda:0" in here)):
        raise UserError(
            f"{option} {name!r} is not available on this machine, which has {', '.join(here)}; "
            "use one of those, or auto"
        )
    return torch.device(name)


def use_tf32(device: torch.device) -> None:
    """On CUDA, let fp32 matmuls and convolutions run on TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulation): several times faster on Ampere and later, and what nanoGPT sets.
    Under bf16 autocast it affects only the matmuls kept in fp32. A process-wide torch setting,
    made where a run chooses its device; CPUs are left as they are (bit-exact resume is tested
    there).

    The legacy flags, not `torch.backends.cuda.matmul.fp32_precision`: torch refuses to read
    `torch.get_float32_matmul_precision()` (as inductor does) once the two APIs are mixed."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def device_argument(name: str) -> torch.device:
    """`resolve_device` as an argparse `type=` for a script's --device: a bad one is argparse's
    usage error (exit 2), naming the device and what is here."""
    try:
        return resolve_device(name, "--device")
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
