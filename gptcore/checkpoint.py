"""Checkpoints: one `.pt` file that holds everything needed to resume a run bit for bit.

Contents: fp32 model weights, optimizer state, step and data position, tokens seen, guard state,
RNG states, the full config, and the tokenizer (tokenizer.json's text, a few hundred KB) with its
hash, so that a checkpoint copied to another folder or machine samples and exports without the
data folder it was trained on. Everything is a tensor or a plain Python value so that
`torch.load(weights_only=True)` can read it.

Layout: the `torch.save` payload, then a 48-byte trailer (a magic tag and the sha256 of every
payload byte). The digest covers the metadata (step, data position, RNG, config) as well as the
tensors, so any changed, missing or extra byte is reported as a damaged checkpoint before
anything is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, BinaryIO

from gptcore.atomic import atomic_file
from gptcore.errors import UserError

FORMAT = "gptrun-checkpoint-v2"
CHECKPOINT_FILE = "checkpoint.pt"  # the file name inside a checkpoint folder (Ray Train)
TRAILER_MAGIC = b"gptrun-sha256-v2"
TRAILER_BYTES = len(TRAILER_MAGIC) + hashlib.sha256().digest_size


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` atomically and durably (temp file, fsync, rename) with its checksum trailer."""
    import torch  # here, not above: `gptrun report` reads CHECKPOINT_FILE and never needs torch

    path = Path(path)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        hashing = _HashingWriter(f)  # hashes the payload as it is written: no second pass
        torch.save({**state, "format": FORMAT}, hashing)
        f.write(TRAILER_MAGIC + hashing.digest.digest())
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
    """Verify, then load a checkpoint; any damage is a one-line `UserError` that names the file."""
    import torch

    path = resolve_checkpoint_path(path)
    size = _verified_payload_size(path)
    with open(path, "rb") as f:
        try:
            state = torch.load(
                io.BufferedReader(_Prefix(f, size)), map_location=map_location, weights_only=True
            )
        except Exception as err:  # torch raises several types for payloads it cannot read
            raise _damaged(path, f"unreadable payload ({type(err).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _damaged(path, f"no {FORMAT} tag in the payload")
    return state


def _verified_payload_size(path: Path) -> int:
    """The payload's length, once its trailer is present and its digest matches."""
    size = path.stat().st_size - TRAILER_BYTES
    if size <= 0:
        raise _damaged(path, "too short to hold a checkpoint")
    with open(path, "rb") as f:
        f.seek(size)
        trailer = f.read()
    if not trailer.startswith(TRAILER_MAGIC):
        raise _damaged(path, "no checksum trailer (truncated, or not written by this gptrun)")
    if _sha256(path, size) != trailer[len(TRAILER_MAGIC) :]:
        raise _damaged(path, "sha256 mismatch")
    return size


def _sha256(path: Path, size: int) -> bytes:
    """sha256 of the first `size` bytes of a file, read in chunks (checkpoints can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while size > 0:
            chunk = f.read(min(size, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            size -= len(chunk)
    return digest.digest()


def _damaged(path: Path, reason: str) -> UserError:
    return UserError(f"damaged checkpoint {path}: {reason}; use an earlier checkpoint or retrain")


class _HashingWriter(io.RawIOBase):
    """A write-only file that feeds every byte to a sha256 on its way to `f`."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self.f, self.digest = f, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.f.write(data)


class _Prefix(io.RawIOBase):
    """A read-only view of a file's first `size` bytes: torch.load reads exactly the verified
    payload, streamed from disk rather than from a second copy of the checkpoint in memory."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        super().__init__()
        self.f, self.size, self.pos = f, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(min(len(buffer), self.size - self.pos), 0)
        self.f.seek(self.pos)
        got = self.f.readinto(memoryview(buffer)[:n]) or 0
        self.pos += got
        return got
