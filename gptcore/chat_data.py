"""Prepared SFT data (`gptrun prepare --sft`): token shards plus a loss mask, and their loader.

Layout: the pretraining layout (meta.json, tokenizer.json, uint16 `split/shard_NNNNN.npy`) with
`"kind": "sft"` in meta.json and two files beside each shard: `shard_NNNNN.mask.npy` (bool, True
where the token is one the model learns to write) and `shard_NNNNN.starts.npy` (int64, where each
conversation starts). Conversations are packed back to back, each followed by <|endoftext|>, and
never cross a shard.

Windows: a training window starts at a conversation start, drawn uniformly per (seed, step) as
for pretraining, and holds seq_len+1 tokens. A shorter conversation is followed by the next ones
in the window (packing; their masks hold, and attention crosses the boundary as it does between
pretraining documents); a longer one is truncated to the window: its tail is never learned, so
raise seq_len or split such conversations (`prepare --sft` reports the lengths against common
seq_len values, and a run's log says how much of its data lies past its own windows). A window
past the end of its shard is padded with <|endoftext|>, masked out. Targets the loss skips are
IGNORE_INDEX in `y`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from gptcore.atomic import atomic_dir
from gptcore.chat import (
    MAX_LINE_BYTES,
    Conversation,
    encode_conversations,
    read_conversations,
    toy_conversations,
)
from gptcore.data import FORMAT_VERSION, IGNORE_INDEX, TokenData, draw
from gptcore.errors import UserError
from gptcore.prepare import check_out, input_fingerprint, reused_tokenizer, up_to_date
from gptcore.tokenizer import file_sha256, require_chat_tokens, save_tokenizer

if TYPE_CHECKING:
    import torch

SHARD_TOKENS = 1 << 24
ENCODE_BATCH = 512  # conversations per tokenizer call (the Rust tokenizer threads over a batch) ...
ENCODE_BATCH_CHARS = 1 << 20  # ... or this many characters of content, whichever comes first


class ChatData(TokenData):
    """A prepared SFT folder: TokenData's shards, plus masks and conversation starts."""

    def __init__(self, dir: str | os.PathLike) -> None:
        super().__init__(dir)
        self._masks = {
            s: [self._side_file(n, "mask", np.bool_) for n in self._names(s)] for s in self._shards
        }
        self._starts = {
            s: [self._side_file(n, "starts", np.int64) for n in self._names(s)] for s in self._shards
        }

    def _names(self, split: str) -> list[str]:
        return self.meta["splits"][split]["shards"]

    def _side_file(self, shard: str, what: str, dtype: type) -> np.ndarray:
        path = self.dir / shard.replace(".npy", f".{what}.npy")
        try:
            array_ = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise UserError(
                f"{path} is missing or unreadable ({err}); re-run `gptrun prepare --sft`"
            ) from None
        if array_.dtype != dtype:
            raise UserError(f"{path} is {array_.dtype}, not {np.dtype(dtype)}; re-run `gptrun prepare --sft`")
        return array_

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
        """As `TokenData.train_batch`, but each window starts at a conversation."""
        counts = [len(s) for s in self._starts["train"]]
        picks = draw(counts, seed, step, micro, rank, world_size, batch_size, grad_accum)
        return self._windows("train", picks, seq_len)

    def beyond_windows(self, seq_len: int) -> str:
        """For a run's log: the train conversations longer than a window (seq_len + 1 tokens
        from their start), and their assistant tokens past it, which training never sees."""
        longer = past = longest = 0
        for starts, shard, mask in zip(
            self._starts["train"], self._shards["train"], self._masks["train"], strict=True
        ):
            ends = np.append(starts[1:], len(shard))
            lengths = ends - starts - 1  # without the <|endoftext|> after each conversation
            longest = max(longest, int(lengths.max(initial=0)))
            for i in np.flatnonzero(lengths > seq_len + 1):
                longer += 1
                past += int(mask[starts[i] + seq_len + 1 : ends[i]].sum())
        train = self.meta["splits"]["train"]
        if not longer:
            return (
                f"SFT data: every train conversation fits a window of model.seq_len={seq_len} "
                f"(the longest has {longest:,} tokens)"
            )
        return (
            f"SFT data: {longer:,} of {train['conversations']:,} train conversations are longer than a "
            f"window of model.seq_len={seq_len} (the longest has {longest:,} tokens); {past:,} of their "
            f"assistant tokens ({100 * past / max(train['learned'], 1):.1f}% of all) lie past it and are "
            "never learned: raise seq_len or split such conversations"
        )

    def num_val_windows(self, seq_len: int, eval_tokens: int) -> int:
        """One window per val conversation, from the first, for about eval_tokens tokens (>= 1)."""
        conversations = sum(len(s) for s in self._starts["val"])
        return max(1, min(conversations, eval_tokens // seq_len))

    def val_batches(
        self, *, seq_len: int, batch_size: int, eval_tokens: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation slice: window i starts at val conversation i, on rank i % world_size."""
        n = self.num_val_windows(seq_len, eval_tokens)
        where = [(k, i) for k, starts in enumerate(self._starts["val"]) for i in range(len(starts))][:n]
        mine = where[rank::world_size]
        for i in range(0, len(mine), batch_size):
            yield self._windows("val", mine[i : i + batch_size], seq_len)

    def _windows(
        self, split: str, picks: Iterable[tuple[int, int]], seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # see gptcore.data's docstring

        ids, learn = [], []
        for k, conversation in picks:
            start = int(self._starts[split][k][conversation])
            window = np.full(seq_len + 1, self.eot_id, dtype=np.int64)
            mask = np.zeros(seq_len + 1, dtype=bool)
            piece = self._shards[split][k][start : start + seq_len + 1]
            window[: len(piece)] = piece
            mask[: len(piece)] = self._masks[split][k][start : start + seq_len + 1]
            ids.append(window)
            learn.append(mask)
        windows, masks = np.stack(ids), np.stack(learn)
        targets = np.where(masks[:, 1:], windows[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(targets)


def open_prepared(dir: str | os.PathLike) -> TokenData:
    """The loader for a prepared folder: ChatData for `gptrun prepare --sft` output, else TokenData."""
    data = TokenData(dir)
    return ChatData(dir) if data.meta.get("kind") == "sft" else data


# Common model.seq_len values: prepare does not know the model's, so it reports against these.
REPORTED_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096)


def prepare_sft(
    inputs: Sequence[str | os.PathLike],
    corpus: str | None,
    *,
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    val_fraction: float | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize conversations (chat JSONL `inputs`, or the toy set of a built-in `corpus`) with a
    pretraining tokenizer into an SFT data folder; return its meta.json.

    Every `round(1 / val_fraction)`-th conversation (default every 20th) goes to val. As for
    `gptrun prepare`, a rerun with the same inputs and options is a no-op and `force` rebuilds.
    A bad conversation stops the run before the folder appears; a line over MAX_LINE_BYTES is
    skipped and counted. The summary gives the distribution of conversation lengths against
    common `model.seq_len` values, since training sees one window from a conversation's start."""
    out, tokenizer = Path(out), Path(tokenizer)
    check_out(out)
    val_fraction = 0.05 if val_fraction is None else val_fraction
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive)")
    every = max(2, round(1 / val_fraction))
    tok = reused_tokenizer(tokenizer)
    require_chat_tokens(tok, tokenizer)
    overlong: list[str] = []
    conversations, source = sft_conversations(inputs, corpus, overlong)
    options = {
        "sft": True,
        "val_fraction": val_fraction,
        "tokenizer": file_sha256(tokenizer),
        "max_line_bytes": MAX_LINE_BYTES,
    }
    fingerprint = input_fingerprint([source], options)
    if not force and (meta := up_to_date(out, fingerprint, side_files=("mask", "starts"))):
        return meta
    lengths = array("I")  # tokens of each conversation, for the summary
    with atomic_dir(out) as tmp:
        save_tokenizer(tok, tmp)
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")  # byte for byte: checkpoints match its sha256
        eot = tok.token_to_id("<|endoftext|>")
        writers = {split: _ChatShardWriter(tmp, split, eot) for split in ("train", "val")}
        bar = functools.partial(tqdm, file=sys.stderr, disable=None if progress else True)
        for index, (ids, mask) in enumerate(_encoded(tok, bar(conversations, desc="encoding", unit=" conv"))):
            writers["val" if index % every == every - 1 else "train"].add(ids, mask)
            lengths.append(len(ids))
        splits = {split: writer.close() for split, writer in writers.items()}
        for split, counts in splits.items():
            if not counts["conversations"]:
                n = len(overlong)
                skipped = (
                    f", after skipping {n:,} line{'s' * (n != 1)} over {MAX_LINE_BYTES >> 20} MiB"
                    if n
                    else ""
                )
                raise UserError(
                    f"{', '.join(source.get('inputs', [])) or source.get('corpus')}: too few "
                    f"conversations for a {split} split (every {every}th goes to val){skipped}; give "
                    "more conversations" + (" or split the long ones" if n else "")
                )
        meta = {
            "format_version": FORMAT_VERSION,
            "kind": "sft",
            "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"),
            "vocab_size": tok.get_vocab_size(),
            "eot_id": eot,
            "splits": splits,
            "conversation_tokens": _length_summary(np.frombuffer(lengths, dtype=np.uint32)),
            "overlong_lines": {"skipped": len(overlong), "first": overlong[:10]},
            "sources": [source],
            "options": options,
            "fingerprint": fingerprint,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _print_summary(out, meta)
    return meta


def _length_summary(lengths: np.ndarray) -> dict:
    """Conversation lengths in tokens: median, 99th percentile, max, and how many are longer
    than a window (seq_len + 1 tokens) of each common seq_len."""
    return {
        "median": int(np.median(lengths)),
        "p99": int(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
        "longer_than_window": {str(n): int((lengths > n + 1).sum()) for n in REPORTED_SEQ_LENS},
    }


def _print_summary(out: Path, meta: dict) -> None:
    t, v = meta["splits"]["train"], meta["splits"]["val"]
    lengths = meta["conversation_tokens"]
    longer = lengths["longer_than_window"]
    print(
        f"{out}: {t['conversations']:,} train / {v['conversations']:,} val conversations, "
        f"{t['tokens']:,} / {v['tokens']:,} tokens; {100 * t['learned'] / max(t['tokens'], 1):.0f}% of "
        "train tokens are assistant turns (what the loss is on, within a training window)"
    )
    print(
        f"  conversation tokens: median {lengths['median']:,}, 99th percentile {lengths['p99']:,}, "
        f"max {lengths['max']:,}; longer than a window of model.seq_len "
        + " / ".join(longer)
        + ": "
        + " / ".join(f"{n:,}" for n in longer.values())
        + " (a window starts at a conversation; the rest of a longer one is never learned: "
        "gptrun train says how much for its seq_len)"
    )
    overlong = meta["overlong_lines"]
    if overlong["skipped"]:
        n = overlong["skipped"]
        shown = ", ".join(overlong["first"][:3]) + (f" and {n - 3:,} more" if n > 3 else "")
        print(
            f"  skipped {n:,} line{'s' * (n != 1)} over {MAX_LINE_BYTES >> 20} MiB (far longer than "
            f"any window, not tokenized): {shown}; split such conversations"
        )


def _encoded(tok, conversations: Iterable[Conversation]) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, mask) per conversation, tokenized in batches of ENCODE_BATCH conversations or
    ENCODE_BATCH_CHARS characters of content, whichever comes first: the tokenizer's offsets
    take some 100 bytes per token, so a batch's memory is bounded by its text."""
    batch: list[Conversation] = []
    chars = 0
    for messages in conversations:
        batch.append(messages)
        chars += sum(len(m["content"]) for m in messages)
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_BATCH_CHARS:
            yield from encode_conversations(tok, batch)
            batch, chars = [], 0
    if batch:
        yield from encode_conversations(tok, batch)


class _ChatShardWriter:
    """Pack conversations into shards of at most SHARD_TOKENS tokens, with masks and starts."""

    def __init__(self, root: Path, split: str, eot: int) -> None:
        self.root, self.split, self.eot = root, split, eot
        (root / split).mkdir()
        self.shards: list[str] = []
        self.counts = {"tokens": 0, "conversations": 0, "learned": 0}
        self._reset()

    def _reset(self) -> None:
        self.ids, self.mask, self.starts = array("H"), array("b"), array("q")

    def add(self, ids: list[int], mask: list[int]) -> None:
        if len(self.ids) and len(self.ids) + len(ids) + 1 > SHARD_TOKENS:
            self._flush()
        self.starts.append(len(self.ids))
        self.ids.extend(ids)
        self.ids.append(self.eot)
        self.mask.extend(mask)
        self.mask.append(0)
        self.counts["conversations"] += 1
        self.counts["learned"] += sum(mask)

    def _flush(self) -> None:
        name = f"{self.split}/shard_{len(self.shards):05d}"
        np.save(self.root / f"{name}.npy", np.frombuffer(self.ids, dtype=np.uint16))
        np.save(self.root / f"{name}.mask.npy", np.frombuffer(self.mask, dtype=np.int8).astype(bool))
        np.save(self.root / f"{name}.starts.npy", np.frombuffer(self.starts, dtype=np.int64))
        self.shards.append(f"{name}.npy")
        self.counts["tokens"] += len(self.ids)
        self._reset()

    def close(self) -> dict:
        if len(self.ids):
            self._flush()
        return {"shards": self.shards, **self.counts}


def sft_conversations(
    inputs: Sequence[str | os.PathLike], corpus: str | None, overlong: list[str]
) -> tuple[Iterator[Conversation], dict]:
    """The conversations `gptrun prepare --sft` reads (lazily), and the source record for
    meta.json and the rerun check: chat JSONL files (resolved paths and sha256, hashed now), or
    the toy set built from a built-in corpus. Lines skipped for their size go to `overlong`."""
    from gptcore.corpora import open_corpus

    if bool(corpus) == bool(inputs):
        raise UserError("give exactly one of --corpus NAME or --input PATH...")
    if corpus:
        if corpus != "shakespeare":
            raise UserError(
                f"--sft --corpus {corpus}: the built-in toy SFT set is made from shakespeare only"
            )
        scenes = open_corpus(corpus)
        return toy_conversations(scenes.documents()), {**scenes.record, "sft": "toy speeches"}
    paths = [Path(p) for p in inputs]
    for path in paths:
        if path.suffix != ".jsonl" or not path.is_file():
            raise UserError(f"--sft reads chat .jsonl files; {path} is not one")
    conversations = (c for path in paths for c in read_conversations(path, overlong))
    return conversations, {
        "inputs": [str(p.resolve()) for p in paths],
        "sha256": [file_sha256(p) for p in paths],
    }
