"""Prepare throughput on a built-in corpus, beside a plain single-threaded encode loop.

Measured in one run, on the same documents with the same tokenizer:
  - the whole `prepare` (read + tokenizer training + parallel encoding + shard writing);
  - its encoding stage alone (`parallel_encode`, worker start-up included);
  - the baseline: `Tokenizer.encode` in a loop, one thread, ids to uint16 as prepare does.

    python benchmarks/prepare.py [--corpus shakespeare] [--vocab-size 6400] [--workers N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from gptcore.corpora import open_corpus
from gptcore.prepare import BATCH_BYTES, parallel_encode, prepare
from gptcore.tokenizer import EOT


def batches(docs: list[str]) -> list[tuple[int, list[str]]]:
    """Tasks of about BATCH_BYTES, as prepare cuts them."""
    out: list[tuple[int, list[str]]] = []
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.encode())
        if size >= BATCH_BYTES:
            out.append((len(out), batch))
            batch, size = [], 0
    return out + ([(len(out), batch)] if batch else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--vocab-size", type=int, default=6400)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    docs = list(open_corpus(args.corpus).documents())
    mb = sum(len(d.encode()) for d in docs) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "data"
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            meta = prepare(
                [],
                args.corpus,
                out,
                vocab_size=args.vocab_size,
                force=True,
                workers=args.workers,
                progress=False,
            )
        whole = time.perf_counter() - start
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tok.token_to_id(EOT)

    start = time.perf_counter()
    parallel = [ids for _, ids in parallel_encode(batches(docs), tok, args.workers)]
    encode = time.perf_counter() - start

    start = time.perf_counter()
    single = []
    for doc in docs:
        ids = tok.encode(doc).ids
        ids.append(eot)
        single.append(np.array(ids, dtype=np.uint16))
    loop = time.perf_counter() - start
    assert np.array_equal(np.concatenate(parallel), np.concatenate(single)), "outputs differ"

    tokens = sum(map(len, single))
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        f"corpus {args.corpus}: {len(docs)} documents, {mb:.2f} MB, {tokens:,} tokens "
        f"(vocab {meta['vocab_size']}, {meta['bytes_per_token']:.2f} bytes/token on val), "
        f"{args.workers} workers, {os.cpu_count()} CPUs"
    )
    print(f"{'stage':<44}{'seconds':>9}{'MB/s':>8}")
    rows = [
        ("prepare, whole (read+train BPE+encode+write)", whole),
        (f"prepare encoding stage ({args.workers} processes)", encode),
        ("baseline: Tokenizer.encode loop, 1 thread", loop),
    ]
    for name, seconds in rows:
        print(f"{name:<44}{seconds:>9.2f}{mb / seconds:>8.2f}")
    print(f"encoding speed-up over the single-threaded loop: {loop / encode:.2f}x")
    print(f"peak RSS: this process {peak_self:.0f} MB, largest worker {peak_child:.0f} MB")


if __name__ == "__main__":
    main()
