"""`gptrun prepare`: documents -> byte-level BPE -> uint16 token shards + meta.json, atomically.

Passes over the (streamed) documents: a scan that checks every document and assigns it to
train or val (and to the tokenizer's sample), tokenizer training on a sample of the train
documents, and parallel encoding into shards. Nothing is written before the scan has passed, and
the output folder appears whole or not at all. Memory does not grow with the corpus: the scan keeps
8 bytes per document, the tokenizer sees at most `tokenizer_sample_mb` of text (BPE training's
word counts grow with the text it sees), and encoding keeps a few batches in flight.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import multiprocessing
import multiprocessing.pool
import os
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from gptcore.atomic import atomic_dir, check_writable_dir
from gptcore.corpora import open_corpus
from gptcore.data import FORMAT_VERSION, VOCAB_LIMIT
from gptcore.errors import UserError
from gptcore.sources import Source, open_inputs
from gptcore.tokenizer import (
    EOT,
    check_vocab_size,
    file_sha256,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

SHARD_TOKENS = 1 << 25  # 64 MiB of uint16 per shard: the most the writer holds in memory
BATCH_DOCS = 1000  # one encoding task: this many documents ...
BATCH_BYTES = 1 << 17  # ... or this many bytes of text, whichever comes first
ROUND_TRIP_DOCS = 16
TOKENIZER_SAMPLE_MB = 8.0  # default cap on the text the tokenizer trains on (see _split)
T = TypeVar("T")


def prepare(
    inputs: Sequence[str | os.PathLike],
    corpus: str | None,
    out: str | os.PathLike,
    vocab_size: int = 6400,
    text_field: str = "text",
    val_fraction: float | None = None,
    tokenizer: str | os.PathLike | None = None,
    force: bool = False,
    errors: str = "strict",
    workers: int | None = None,
    progress: bool = True,
    tokenizer_sample_mb: float | None = None,
) -> dict:
    """Build (or find up to date) the prepared data folder `out`; return its meta.json."""
    started = time.perf_counter()
    out = Path(out)
    check_out(out)
    if errors not in ("strict", "replace"):
        raise UserError(f"--errors {errors!r}: expected 'strict' or 'replace'")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive)")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    if tokenizer_sample_mb is None:
        tokenizer_sample_mb = TOKENIZER_SAMPLE_MB
    if tokenizer_sample_mb <= 0:
        raise UserError(f"--tokenizer-sample-mb {tokenizer_sample_mb} must be positive")
    tok = reused_tokenizer(Path(tokenizer)) if tokenizer else None
    if tok is None:
        check_vocab_size(vocab_size)
    if bool(corpus) == bool(inputs):
        raise UserError("give exactly one of --corpus NAME or --input PATH...")
    sources = [open_corpus(corpus)] if corpus else open_inputs(inputs, text_field, errors, progress)
    options = {
        "vocab_size": tok.get_vocab_size() if tok else vocab_size,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "errors": errors,
        "tokenizer": file_sha256(tokenizer) if tokenizer else None,
        "tokenizer_sample_mb": None if tokenizer else tokenizer_sample_mb,
    }
    fingerprint = input_fingerprint([s.record for s in sources], options)
    if not force and (meta := up_to_date(out, fingerprint)):
        return meta

    bar = functools.partial(tqdm, file=sys.stderr, disable=None if progress else True)
    docs = functools.partial(_documents, sources)
    in_val, in_sample, total_bytes = _split(
        bar(docs(), desc="reading", unit=" docs"), val_fraction, tokenizer_sample_mb * 1e6
    )
    timings = {"read": time.perf_counter() - started}
    docs = functools.partial(_documents, sources, len(in_val))

    if tok is None:
        tok = train_tokenizer(
            itertools.compress(docs(), in_sample),
            vocab_size,
            progress=progress and sys.stderr.isatty(),
            length=int(in_sample.sum()),
        )
        timings["tokenizer"] = time.perf_counter() - started - sum(timings.values())
    eot = tok.token_to_id(EOT)

    counts = {split: {"tokens": 0, "bytes": 0, "documents": 0} for split in ("train", "val")}
    n_tasks = max(-(-total_bytes // BATCH_BYTES), -(-len(in_val) // BATCH_DOCS)) + 1
    workers = min(workers or os.cpu_count() or 1, n_tasks)  # no idle processes to start
    with atomic_dir(out) as tmp:
        save_tokenizer(tok, tmp)
        writers = {split: _ShardWriter(tmp, split) for split in counts}
        with bar(total=total_bytes, desc="encoding", unit="B", unit_scale=True) as progress_bar:
            for (split, nbytes), ids in parallel_encode(_batches(docs(), in_val, counts), tok, workers):
                writers[split].write(ids)
                progress_bar.update(nbytes)
        for split, writer in writers.items():
            counts[split]["shards"] = writer.close()
            counts[split]["tokens"] = writer.tokens
        timings["encode"] = time.perf_counter() - started - sum(timings.values())
        meta = {
            "format_version": FORMAT_VERSION,
            "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"),
            "vocab_size": tok.get_vocab_size(),
            "eot_id": eot,
            "splits": counts,
            "bytes_per_token": counts["val"]["bytes"] / counts["val"]["tokens"],
            "sources": [s.record for s in sources],
            "options": options,
            "fingerprint": fingerprint,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        checked = _round_trip(
            tok,
            (d for d, v in zip(docs(), in_val, strict=True) if v),
            [tmp / s for s in counts["val"]["shards"]],
        )
        _require_round_trip(checked, out)  # before the folder is committed
    _print_summary(
        out,
        meta,
        checked,
        timings,
        workers,
        sampled=None if tokenizer else int(in_sample.sum()),
        seconds=time.perf_counter() - started,
    )
    return meta


def check_out(out: Path) -> None:
    """Refuse, before any work, outputs that cannot be written or would overwrite something
    that is not ours."""
    check_writable_dir(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not (out / "meta.json").is_file():
        raise UserError(
            f"--out {out} is a non-empty folder not written by gptrun prepare; "
            "choose another --out or empty it"
        )


def reused_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json given with --tokenizer, checked to fit uint16 shards and to have <|endoftext|>."""
    tok = load_tokenizer(path)
    if tok.token_to_id(EOT) is None:
        raise UserError(
            f"tokenizer {path} has no {EOT} token, which separates documents; "
            "train one with `gptrun prepare` instead of --tokenizer"
        )
    if tok.get_vocab_size() > VOCAB_LIMIT:
        raise UserError(
            f"tokenizer {path} has {tok.get_vocab_size()} tokens but uint16 shards "
            f"hold at most {VOCAB_LIMIT}; use a smaller tokenizer"
        )
    return tok


def input_fingerprint(records: list[dict], options: dict) -> str:
    """What the output depends on (the sources' records, with their sha256, and the options);
    equal fingerprints mean a rerun would write the same."""
    blob = json.dumps(
        {"format_version": FORMAT_VERSION, "sources": records, "options": options}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def up_to_date(out: Path, fingerprint: str, side_files: tuple[str, ...] = ()) -> dict | None:
    """The existing meta.json if `out` is complete (its tokenizer, every shard and each shard's
    `side_files`, e.g. "mask" for `shard_00000.mask.npy`) and was built from the same inputs;
    says so on stdout. A rerun of the same command is then a no-op."""
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
        shards = [s for split in meta["splits"].values() for s in split["shards"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    files = [
        "tokenizer.json",
        *shards,
        *(s.replace(".npy", f".{side}.npy") for s in shards for side in side_files),
    ]
    if meta.get("fingerprint") != fingerprint or not all((out / f).is_file() for f in files):
        return None
    print(f"{out} is up to date (use --force to rebuild)")
    return meta


def _documents(sources: list[Source], count: int | None = None) -> Iterator[str]:
    """All non-blank documents of all sources, in order (the index is the document's id).

    Each pass over an input file ends with a check that the file is the one hashed, and passes
    after the first give `count`, the first pass's document count: an input that changes while
    prepare reads it is refused in one line that names it, before anything is written."""
    seen = 0
    for source in sources:
        for doc in source.documents():
            if doc and not doc.isspace():
                seen += 1
                if count is not None and seen > count:
                    raise source.changed()
                yield doc
        source.check_unchanged()


def _split(
    docs: Iterable[str], val_fraction: float | None, sample_bytes: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """Read every document once (so bad input fails before anything is written) and put it in
    val when a hash of (index, text) falls below the fraction: deterministic, spread over the
    whole corpus, and blind to document length. Holds 8 bytes per document, never the text.

    The tokenizer's sample is the train documents whose hash's low 32 bits (independent of the
    high bits that pick val) fall below sample_bytes / total bytes: about `sample_bytes` of text
    drawn evenly from the whole corpus, all of the train documents when the corpus is smaller.
    Returns the val mask, the sample mask and the total UTF-8 bytes."""
    hashes, total = array("Q"), 0
    for index, doc in enumerate(docs):
        data = doc.encode("utf-8")
        total += len(data)
        digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8)
        digest.update(data)
        hashes.append(int.from_bytes(digest.digest(), "little"))
    if not hashes:
        raise UserError(
            "no text in the inputs: every document is empty or whitespace; check the files and --text-field"
        )
    if len(hashes) < 2:
        raise UserError(
            "only 1 non-empty document, but train and val need one each; add "
            f"documents or separate them with {EOT} in a .txt file"
        )
    # Default: ~300k val tokens at ~3.5 bytes/token, at least 1% and at most 10% of documents.
    fraction = val_fraction or max(0.01, min(0.10, 300_000 * 3.5 / total))
    h = np.frombuffer(hashes, dtype=np.uint64)
    in_val = h < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    if not in_val.any():
        in_val[h.argmin()] = True
    if in_val.all():
        in_val[h.argmax()] = False
    low = h & np.uint64(0xFFFFFFFF)
    in_sample = ~in_val & (low < np.uint64(min(sample_bytes / total, 1.0) * 2.0**32))
    if not in_sample.any():  # a sample too small for any document: the train document first in line
        in_sample[np.where(in_val, np.uint64(2**64 - 1), low).argmin()] = True
    return in_val, in_sample, total


def _batches(
    docs: Iterable[str], in_val: np.ndarray, counts: dict
) -> Iterator[tuple[tuple[str, int], list[str]]]:
    """Group documents by split into encoding tasks tagged (split, bytes); count docs/bytes."""
    batch: dict[str, list[str]] = {"train": [], "val": []}
    size = {"train": 0, "val": 0}
    for doc, val in zip(docs, in_val, strict=True):
        split = "val" if val else "train"
        n = len(doc.encode("utf-8"))
        counts[split]["documents"] += 1
        counts[split]["bytes"] += n
        batch[split].append(doc)
        size[split] += n
        if len(batch[split]) >= BATCH_DOCS or size[split] >= BATCH_BYTES:
            yield (split, size[split]), batch[split]
            batch[split], size[split] = [], 0
    for split, docs_left in batch.items():
        if docs_left:
            yield (split, size[split]), docs_left


def parallel_encode(
    batches: Iterable[tuple[T, list[str]]], tok: Tokenizer, workers: int
) -> Iterator[tuple[T, np.ndarray]]:
    """Encode batches of documents in `workers` processes; yield (tag, uint16 ids) in input
    order, each document followed by EOT. At most 2 * workers batches are in flight, so memory
    stays bounded however large the corpus is."""
    eot = tok.token_to_id(EOT)
    with _pool(workers, tok.to_str(), eot) as pool:
        pending: collections.deque = collections.deque()
        for tag, docs in batches:
            pending.append((tag, pool.apply_async(_encode_batch, (docs,))))
            if len(pending) >= 2 * workers:
                tag, result = pending.popleft()
                yield tag, result.get()
        while pending:
            tag, result = pending.popleft()
            yield tag, result.get()


def _pool(workers: int, tokenizer_json: str, eot: int) -> multiprocessing.pool.Pool:
    """Forked workers (spawn would re-import the caller's __main__, which breaks under some
    hosts). TOKENIZERS_PARALLELISM=false while forking gives each child one thread, the pool
    being the parallelism, and silences the tokenizers warning about forking after training."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json, eot))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


_worker: tuple[Tokenizer, int] | None = None


def _init_worker(tokenizer_json: str, eot: int) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # for spawned workers, see _pool
    _worker = (Tokenizer.from_str(tokenizer_json), eot)


def _encode_batch(docs: list[str]) -> np.ndarray:
    assert _worker is not None, "runs in a pool started with _init_worker"
    tok, eot = _worker
    ids: list[int] = []
    for encoding in tok.encode_batch_fast(docs):  # the same ids, without the offsets
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.uint16)


class _ShardWriter:
    """Append uint16 ids to a split; every SHARD_TOKENS ids become one .npy shard."""

    def __init__(self, root: Path, split: str) -> None:
        self.root, self.split = root, split
        self.buffer = np.empty(SHARD_TOKENS, dtype=np.uint16)  # pages are touched as filled
        self.fill = self.tokens = 0
        self.shards: list[str] = []
        (root / split).mkdir()

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            n = min(len(ids), len(self.buffer) - self.fill)
            self.buffer[self.fill : self.fill + n] = ids[:n]
            self.fill, ids = self.fill + n, ids[n:]
            if self.fill == len(self.buffer):
                self._flush()

    def _flush(self) -> None:
        if self.fill:
            name = f"{self.split}/shard_{len(self.shards):05d}.npy"
            np.save(self.root / name, self.buffer[: self.fill])
            self.shards.append(name)
            self.tokens += self.fill
            self.fill = 0

    def close(self) -> list[str]:
        self._flush()
        return self.shards


def _round_trip(tok: Tokenizer, val_docs: Iterable[str], val_shards: list[Path]) -> dict:
    """Check the first val documents: decode(encode(doc)) == doc, and the val shards start with
    exactly their ids (so the workers and the writer lost nothing). Also counts unknown tokens."""
    unk = getattr(tok.model, "unk_token", None)
    unk_id = tok.token_to_id(unk) if unk else None
    ok = docs = tokens = unknown = 0
    expected: list[int] = []
    for doc in itertools.islice(val_docs, ROUND_TRIP_DOCS):
        ids = tok.encode(doc).ids
        ok += tok.decode(ids, skip_special_tokens=False) == doc
        docs += 1
        tokens += len(ids)
        unknown += sum(i == unk_id for i in ids) if unk_id is not None else 0
        expected += [*ids, tok.token_to_id(EOT)]
    shard_ok = np.array_equal(_leading_ids(val_shards, len(expected)), expected)
    return {"docs": docs, "ok": ok, "shard_ok": shard_ok, "unknown_rate": unknown / max(tokens, 1)}


def _leading_ids(shards: list[Path], n: int) -> np.ndarray:
    """The first n token ids of a split, reading only the shards that hold them."""
    parts, held = [], 0
    for shard in shards:
        if held >= n:
            break
        parts.append(np.load(shard, mmap_mode="r")[: n - held])
        held += len(parts[-1])
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _require_round_trip(checked: dict, out: Path) -> None:
    """A tokenizer that loses text (a reused one with a normalizer, say) or shards that differ
    from the encoding would train a model on the wrong data: fail, and write nothing."""
    if checked["ok"] < checked["docs"]:
        raise UserError(
            f"round trip failed: decode(encode(doc)) != doc for "
            f"{checked['docs'] - checked['ok']} of {checked['docs']} val documents, "
            f"so the tokenizer loses text; use a byte-level BPE (drop --tokenizer); "
            f"{out} was not written"
        )
    if not checked["shard_ok"]:
        raise UserError(
            f"round trip failed: the val shard does not hold the ids of its first "
            f"{checked['docs']} documents (an encoding bug); {out} was not written"
        )


def _print_summary(
    out: Path,
    meta: dict,
    checked: dict,
    timings: dict[str, float],
    workers: int,
    sampled: int | None,
    seconds: float,
) -> None:
    splits = meta["splits"]
    encoded_mb = (splits["train"]["bytes"] + splits["val"]["bytes"]) / 1e6
    round_trip = f"ok on {checked['docs']} val docs"
    tokenizer = "reused tokenizer" if sampled is None else f"tokenizer trained on {sampled:,} train docs"
    print(
        f"wrote {out} in {seconds:.1f} s: vocab {meta['vocab_size']} ({tokenizer}), eot id {meta['eot_id']}"
    )
    print(f"  {'split':<6}{'tokens':>14}{'bytes':>14}{'docs':>9}{'shards':>8}")
    for name, s in splits.items():
        print(f"  {name:<6}{s['tokens']:>14,}{s['bytes']:>14,}{s['documents']:>9,}{len(s['shards']):>8}")
    print(
        f"  val bytes/token {meta['bytes_per_token']:.2f} | round trip {round_trip} | "
        f"unknown tokens {checked['unknown_rate']:.2%}"
    )
    print(
        "  time: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
        + f" | encode {encoded_mb / max(timings['encode'], 1e-9):.1f} MB/s on {workers} workers"
    )
