"""The loader: batches from a prepared data folder (meta.json + memory-mapped uint16 shards).

Batches are pure functions of their arguments, never of loader state: a training batch is
fixed by (seed, step, micro, rank), so a resumed run sees exactly the batches it would have seen,
and N DDP workers with batch B see exactly the windows one worker with batch N*B sees. The same
purity lets `Prefetcher` build the next batches on a thread while the step runs.

This module also holds the one definition of the data format's constants and of gptrun's cache
folder. `prepare`, `config` and `corpora` import them and start without torch (~2 s), so torch
is imported where batches become tensors.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import platformdirs

from gptcore.errors import UserError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1  # meta.json's format_version: what prepare writes and TokenData reads
VOCAB_LIMIT = 1 << 16  # uint16 shards hold ids 0..65535, so a vocabulary of up to 65536 tokens
IGNORE_INDEX = -1  # a target the loss skips (SFT: tokens of prompts, not of assistant turns)


def cache_dir() -> Path:
    """gptrun's cache folder (corpora, the CPU peak FLOP/s): $GPTRUN_CACHE_DIR, else the
    platform's user cache dir."""
    override = os.environ.get("GPTRUN_CACHE_DIR")
    if override:
        return Path(override)
    return Path(platformdirs.user_cache_dir("gptrun"))


class TokenData:
    """A prepared data folder, memory-mapped: opening it reads only meta.json and shard headers."""

    def __init__(self, dir: str | os.PathLike) -> None:
        self.dir = Path(dir)
        hint = f"run `gptrun prepare --out {self.dir}` first"
        meta_path = self.dir / "meta.json"
        if not self.dir.is_dir():
            raise UserError(f"data folder not found: {self.dir}; {hint}")
        try:
            self.meta: dict = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{meta_path} not found; {hint}") from None
        except (OSError, ValueError) as err:
            raise UserError(f"{meta_path} is not readable JSON ({err}); {hint}") from None
        try:
            if self.meta["format_version"] != FORMAT_VERSION:
                raise UserError(
                    f"{meta_path} has format_version {self.meta['format_version']}, "
                    f"this gptrun reads {FORMAT_VERSION}; {hint}"
                )
            self.vocab_size: int = int(self.meta["vocab_size"])
            self.tokenizer_sha256: str = self.meta["tokenizer_sha256"]
            self.eot_id: int = int(self.meta["eot_id"])
            self._shards = {
                split: [self._open_shard(name) for name in self.meta["splits"][split]["shards"]]
                for split in ("train", "val")
            }
        except (KeyError, TypeError) as err:
            raise UserError(f"{meta_path} is incomplete ({err!r}); {hint}") from None
        self.tokenizer_path = self.dir / "tokenizer.json"

    def _open_shard(self, name: str) -> np.ndarray:
        path = self.dir / name
        try:
            shard = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise UserError(
                f"token shard {path} is missing or unreadable ({err}); re-run "
                f"`gptrun prepare --out {self.dir} --force`"
            ) from None
        if shard.dtype != np.uint16 or shard.ndim != 1:
            raise UserError(
                f"token shard {path} is {shard.dtype}{list(shard.shape)}, not 1-D "
                f"uint16; re-run `gptrun prepare --out {self.dir} --force`"
            )
        return shard

    def tokenizer_text(self) -> str:
        """The folder's tokenizer.json, as text, checked to be the one its shards were made with
        (the sha256 in meta.json). Checkpoints carry it, so that they sample and export away from
        this folder."""
        try:
            data = self.tokenizer_path.read_bytes()
        except OSError as err:
            raise UserError(
                f"{self.tokenizer_path} is missing or unreadable ({err.strerror}); re-run "
                f"`gptrun prepare --out {self.dir} --force`"
            ) from None
        if hashlib.sha256(data).hexdigest() != self.tokenizer_sha256:
            raise UserError(
                f"{self.tokenizer_path} is not the tokenizer the shards of {self.dir} were made with "
                f"(its sha256 is not the one in meta.json); re-run `gptrun prepare --out {self.dir} --force`"
            )
        return data.decode("utf-8")

    def __reduce__(self) -> tuple:
        """Pickle as the folder path: memory maps would otherwise be copied whole (Ray)."""
        return (type(self), (self.dir,))

    def train_batch(
        self,
        *,
        seed: int,
        step: int,
        micro: int,
        rank: int,
        world_size: int,
        batch_size: int,
        grad_accum: int,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, (batch_size, seq_len) int64, for one micro-batch.

        One global draw of grad_accum * world_size * batch_size windows per (seed, step),
        uniform over every window that fits inside a shard; (micro, rank) takes its slice.
        """
        shards = self._shards["train"]
        starts_per_shard = [max(len(s) - seq_len, 0) for s in shards]
        if not sum(starts_per_shard):
            raise UserError(
                f"train split of {self.dir} has no shard longer than seq_len+1 = "
                f"{seq_len + 1} tokens; use a smaller seq_len or more data"
            )
        picks = draw(starts_per_shard, seed, step, micro, rank, world_size, batch_size, grad_accum)
        return _shifted(np.stack([shards[k][o : o + seq_len + 1] for k, o in picks]))

    def num_val_windows(self, seq_len: int, eval_tokens: int) -> int:
        """How many seq_len+1 windows (stride seq_len) of val the first eval_tokens hold (>= 1)."""
        total = sum(len(s) for s in self._shards["val"])
        if total < seq_len + 1:
            raise UserError(
                f"val split of {self.dir} has {total} tokens, fewer than one window "
                f"of seq_len+1 = {seq_len + 1}; use a smaller seq_len or re-run "
                "`gptrun prepare` with a larger --val-fraction"
            )
        return max(1, (min(eval_tokens, total) - 1) // seq_len)

    def val_batches(
        self, *, seq_len: int, batch_size: int, eval_tokens: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation slice: consecutive windows from the start of val, window i on
        rank i % world_size, in batches of batch_size. Ranks may differ by one window, so sum
        loss and token counts across ranks rather than averaging per-rank means."""
        n = self.num_val_windows(seq_len, eval_tokens)
        need, parts = n * seq_len + 1, []
        for shard in self._shards["val"]:  # read only the head of the val split
            parts.append(shard[: need - sum(map(len, parts))])
        tokens = np.concatenate(parts)
        mine = range(rank, n, world_size)
        for i in range(0, len(mine), batch_size):
            starts = [w * seq_len for w in mine[i : i + batch_size]]
            yield _shifted(np.stack([tokens[s : s + seq_len + 1] for s in starts]))


def draw(
    counts: list[int],
    seed: int,
    step: int,
    micro: int,
    rank: int,
    world_size: int,
    batch_size: int,
    grad_accum: int,
) -> list[tuple[int, int]]:
    """(shard, index in shard) for each of one micro-batch's windows, out of `counts[k]` choices
    in shard k: one global uniform draw of grad_accum * world_size * batch_size per (seed, step),
    of which (micro, rank) takes its slice."""
    if not (0 <= micro < grad_accum and 0 <= rank < world_size):
        raise ValueError(f"micro={micro} rank={rank} outside grad_accum={grad_accum} world_size={world_size}")
    sizes = np.array(counts, dtype=np.int64)
    ends = np.cumsum(sizes)
    picks = np.random.default_rng([seed, step]).integers(
        0, ends[-1], size=grad_accum * world_size * batch_size
    )
    first = (micro * world_size + rank) * batch_size
    picks = picks[first : first + batch_size]
    shard_of = np.searchsorted(ends, picks, side="right")
    return list(zip(shard_of.tolist(), (picks - (ends[shard_of] - sizes[shard_of])).tolist(), strict=True))


def _shifted(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """x = window[:-1], y = window[1:]: the loss needs no slicing of logits."""
    import torch  # see the module docstring

    t = torch.from_numpy(windows.astype(np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


Key = tuple[int, int]  # (batch index, micro-step): what a training micro-batch is a function of


class Prefetcher:
    """Training micro-batches built on a background thread while the step runs, in pinned memory
    on CUDA so that the step's `.to(device, non_blocking=True)` copies without blocking the host.

    `make(step=batch_index, micro=micro)` builds one micro-batch and is a pure function of its key
    (see `draw`), so a batch built ahead is exactly the batch the step would build. `get(key)`
    returns key's batch and queues the `depth` keys that follow it; a key it did not predict (a
    resume, a rollback that moves the data position, a timing step that reads a batch again) is
    built on request, and queued batches that no longer follow are dropped: what comes back
    depends only on the key asked for, never on what was queued.

    The thread is a daemon and holds no reference to the prefetcher, so it ends when the
    prefetcher (its Trainer) is collected, whether the run ended or raised."""

    def __init__(
        self,
        make: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        grad_accum: int,
        device: torch.device,
        depth: int = 2,
    ) -> None:
        import torch  # see the module docstring

        self.make, self.grad_accum, self.depth = make, grad_accum, depth
        self.pin = device.type == "cuda"
        gpu = None  # the GPU in whose context the thread pins: "cuda" is this thread's current one
        if self.pin:
            gpu = torch.cuda.current_device() if device.index is None else device.index
        self.queued: dict[Key, Future] = {}
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_serve, args=(self.requests, gpu), name="gptrun-batches", daemon=True
        )
        self.thread.start()
        weakref.finalize(self, self.requests.put, None)  # the thread's signal to end

    def get(self, batch_index: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of batch `batch_index` (pinned on CUDA), the next ones queued."""
        key = (batch_index, micro)
        future = self.queued.pop(key, None) or self._submit(key)
        ahead = self._following(key)
        for stale in [k for k in self.queued if k not in ahead]:
            self.queued.pop(stale).cancel()  # one already being built is built, then dropped
        for k in ahead:
            if k not in self.queued:
                self.queued[k] = self._submit(k)
        return future.result()

    def _following(self, key: Key) -> list[Key]:
        """The `depth` keys a run reads after `key`: the next micro-steps, then the next batch."""
        keys = []
        index, micro = key
        for _ in range(self.depth):
            index, micro = (index, micro + 1) if micro + 1 < self.grad_accum else (index + 1, 0)
            keys.append((index, micro))
        return keys

    def _submit(self, key: Key) -> Future:
        future: Future = Future()
        self.requests.put((future, functools.partial(_build, self.make, key, self.pin)))
        return future


def _build(
    make: Callable[..., tuple[torch.Tensor, torch.Tensor]], key: Key, pin: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make(step=key[0], micro=key[1])
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def _serve(requests: queue.SimpleQueue, gpu: int | None) -> None:
    """The prefetch thread: run each (future, job) in turn until a None arrives."""
    import torch  # see the module docstring

    if gpu is not None:
        torch.cuda.set_device(gpu)  # else the thread would make a context on GPU 0 to pin in
    for future, job in iter(requests.get, None):
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as err:  # raised to the step that asks for this batch
                future.set_exception(err)
