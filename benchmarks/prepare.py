"""Prepare throughput and memory, beside a plain single-threaded encode loop.

Two modes, each measured in one run:

  - a built-in corpus (default shakespeare): the whole `prepare` (read + tokenizer training +
    parallel encoding + shard writing), its encoding stage alone (`parallel_encode`, worker
    start-up included) and the baseline, `Tokenizer.encode` in a loop on one thread with ids to
    uint16 as prepare does, on the same documents with the same tokenizer;
  - `--synthetic-gb G`: a generated MiniMind-like JSONL (mostly Chinese-like text, some English
    lines, `<|im_start|>`/`<|im_end|>` markers) of G GB, written once to a temp folder with its
    0.1 G and 0.5 G prefixes; `prepare` runs on each size in its own process while this one
    samples the memory of that process and its workers (PSS summed over them, and the largest
    one's peak RSS), so a peak that grows with the input shows. The encoding speed-up is then
    measured on the first 20 MB of it as above.

    python benchmarks/prepare.py [--corpus shakespeare] [--vocab-size 6400] [--workers N]
    python benchmarks/prepare.py --synthetic-gb 1 [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from gptcore.corpora import open_corpus
from gptcore.prepare import BATCH_BYTES, parallel_encode, prepare
from gptcore.sources import jsonl_documents
from gptcore.tokenizer import EOT

SIZES = (0.1, 0.5, 1.0)  # fractions of --synthetic-gb that prepare runs on
SPEEDUP_BYTES = 20_000_000  # the slice of the synthetic corpus the encode speed-up is measured on


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


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the pool's workers, once it closed)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def encode_speedup(docs: list[str], tok: Tokenizer, workers: int, rounds: int) -> dict[str, float]:
    """prepare's encoding stage and the single-threaded loop on the same docs (same ids checked),
    alternated `rounds` times: median wall seconds of each, and the CPU seconds each spent (all
    processes), whose ratio is the work per byte, which the machine's other load does not change."""
    eot = tok.token_to_id(EOT)
    walls: dict[str, list[float]] = {"encode": [], "loop": []}
    cpus: dict[str, list[float]] = {"encode": [], "loop": []}
    for _ in range(rounds):
        start, cpu = time.perf_counter(), _cpu_seconds()
        parallel = [ids for _, ids in parallel_encode(batches(docs), tok, workers)]
        walls["encode"].append(time.perf_counter() - start)
        cpus["encode"].append(_cpu_seconds() - cpu)

        start, cpu = time.perf_counter(), _cpu_seconds()
        single = []
        for doc in docs:
            ids = tok.encode(doc).ids
            ids.append(eot)
            single.append(np.array(ids, dtype=np.uint16))
        walls["loop"].append(time.perf_counter() - start)
        cpus["loop"].append(_cpu_seconds() - cpu)
        assert np.array_equal(np.concatenate(parallel), np.concatenate(single)), "outputs differ"
    medians = {k: statistics.median(v) for k, v in walls.items()}
    return {**medians, **{f"{k}_cpu": statistics.median(v) for k, v in cpus.items()}}


def print_speedup(mb: float, workers: int, t: dict[str, float]) -> None:
    print(f"{'stage':<44}{'seconds':>9}{'MB/s':>8}{'CPU s':>8}")
    for name, key in (
        (f"prepare encoding stage ({workers} processes)", "encode"),
        ("baseline: Tokenizer.encode loop, 1 thread", "loop"),
    ):
        print(f"{name:<44}{t[key]:>9.2f}{mb / t[key]:>8.2f}{t[key + '_cpu']:>8.2f}")
    print(
        f"encoding speed-up over the single-threaded loop: {t['loop'] / t['encode']:.2f}x wall-clock on "
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); CPU seconds, loop / "
        f"prepare: {t['loop_cpu'] / t['encode_cpu']:.2f}"
    )


def corpus_mode(args: argparse.Namespace) -> None:
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
    timings = encode_speedup(docs, tok, args.workers, args.rounds)
    print(
        f"corpus {args.corpus}: {len(docs)} documents, {mb:.2f} MB, "
        f"(vocab {meta['vocab_size']}, {meta['bytes_per_token']:.2f} bytes/token on val), "
        f"{args.workers} workers; whole prepare (read+train BPE+encode+write) {whole:.2f} s"
    )
    print_speedup(mb, args.workers, timings)
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS: this process {peak_self:.0f} MB, largest worker {peak_child:.0f} MB")


# ------------------------------------------------------------------ synthetic MiniMind-like corpus
def synthetic_documents(seed: int = 0) -> Iterator[str]:
    """Endless documents of ~0.3-2 KB: sentences of 4-40 characters drawn (Zipf-like) from 3,500
    CJK ideographs, 1 in 5 an English line of Shakespeare, each document wrapped in ChatML markers
    as MiniMind's pretraining text is. Chinese-like text has few spaces, so the byte-level
    pre-tokenizer sees long, mostly distinct 'words': the case where tokenizer training's memory
    grows with the corpus."""
    rng = np.random.default_rng(seed)
    english = [
        line.strip()
        for doc in open_corpus("shakespeare").documents()
        for line in doc.splitlines()
        if line.strip()
    ]
    weights = 1.0 / np.arange(1, 3501) ** 0.9
    codepoints = 0x4E00 + rng.permutation(0x5000)[:3500]
    while True:
        # One block of characters for many documents, decoded at once (fast), then sliced.
        chars = rng.choice(codepoints, size=1 << 20, p=weights / weights.sum()).astype("<u4")
        block = chars.tobytes().decode("utf-32-le")
        lengths = rng.integers(4, 40, size=len(block) // 4)
        kinds = rng.random(len(lengths))
        sentences, at = [], 0
        for length, kind in zip(lengths, kinds, strict=True):
            if at + length > len(block):
                break
            if kind < 0.2:
                sentences.append(english[int(kind * 5 * len(english))] + " ")
            else:
                sentences.append(block[at : at + length] + ("。" if kind > 0.7 else "，"))
                at += length
        per_doc = rng.integers(8, 60, size=len(sentences) // 8)
        start = 0
        for n in per_doc:
            if start + n > len(sentences):
                break
            yield "<|im_start|>" + "".join(sentences[start : start + n]) + "<|im_end|>"
            start += n


def write_synthetic(folder: Path, gigabytes: float) -> list[Path]:
    """JSONL files of gigabytes * SIZES (each a prefix of the next), reused if already there."""
    paths = [folder / f"synthetic_{gigabytes * s:g}gb.jsonl" for s in SIZES]
    if all(p.is_file() for p in paths):
        return paths
    limits = [int(gigabytes * s * 1e9) for s in SIZES]
    files = [open(p.with_suffix(".tmp"), "wb") for p in paths]  # noqa: SIM115 (closed below)
    written, start = 0, time.perf_counter()
    for doc in synthetic_documents():
        line = (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode()
        for f, limit in zip(files, limits, strict=True):
            if written < limit:
                f.write(line)
        written += len(line)
        if written >= limits[-1]:
            break
    for f, p in zip(files, paths, strict=True):
        f.close()
        os.replace(p.with_suffix(".tmp"), p)
    print(f"wrote {', '.join(p.name for p in paths)} in {time.perf_counter() - start:.0f} s", flush=True)
    return paths


def _tree(pid: int) -> list[int]:
    """pid and its descendants (the pool workers), from /proc."""
    found, i = [pid], 0
    while i < len(found):
        try:
            for task in os.listdir(f"/proc/{found[i]}/task"):
                with open(f"/proc/{found[i]}/task/{task}/children") as f:
                    found += [int(c) for c in f.read().split()]
        except OSError:
            pass
        i += 1
    return found


def _pss_mb(pid: int) -> float:
    """Proportional set size: resident memory with pages shared between processes (the forked
    workers share the main process's) split among them, so a sum over processes counts each
    page once."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration):  # the process just ended
        return 0.0


def measure_prepare(path: Path, out: Path, workers: int, vocab_size: int) -> dict:
    """Run `gptrun prepare` on path in a child process; sample the PSS of it and its workers 5
    times a second, and take the largest process's exact peak RSS from the kernel at exit."""
    cmd = [sys.executable, "-m", "experiments", "prepare", "--input", str(path), "--out", str(out)]
    cmd += ["--vocab-size", str(vocab_size), "--workers", str(workers), "--force"]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak_pss = 0.0
    while True:
        peak_pss = max(peak_pss, sum(map(_pss_mb, _tree(child.pid))))
        done, status, usage = os.wait4(child.pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    output = child.stdout.read() if child.stdout else ""
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"prepare failed on {path}:\n{output}")
    return {"seconds": seconds, "peak_pss": peak_pss, "peak_rss": usage.ru_maxrss / 1024, "summary": output}


def synthetic_mode(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        folder = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        paths = write_synthetic(folder, args.synthetic_gb)
        rows = []
        for path in paths:
            result = measure_prepare(path, folder / "out", args.workers, args.vocab_size)
            rows.append((path.name, path.stat().st_size / 1e9, result))
            print(f"{path.name}: {result['seconds']:.0f} s\n{result['summary']}", flush=True)
        tok = Tokenizer.from_file(str(folder / "out" / "tokenizer.json"))
        docs, size = [], 0
        for doc in jsonl_documents(paths[0]):
            docs.append(doc)
            size += len(doc.encode())
            if size >= SPEEDUP_BYTES:
                break
        timings = encode_speedup(docs, tok, args.workers, args.rounds)

    print(
        f"\n{'input':<24}{'GB':>6}{'seconds':>9}{'MB/s':>7}"
        f"{'peak PSS, all processes':>25}{'peak RSS, largest':>19}"
    )
    for name, gb, r in rows:
        print(
            f"{name:<24}{gb:>6.2f}{r['seconds']:>9.0f}{gb * 1e3 / r['seconds']:>7.2f}"
            f"{r['peak_pss']:>22.0f} MB{r['peak_rss']:>16.0f} MB"
        )
    print(f"\nencoding speed-up on the first {size / 1e6:.0f} MB ({len(docs):,} documents):")
    print_speedup(size / 1e6, args.workers, timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--vocab-size", type=int, default=6400)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--synthetic-gb", type=float, help="prepare a generated JSONL of this many GB")
    parser.add_argument("--rounds", type=int, default=3, help="alternated encode/loop measurements")
    parser.add_argument("--keep", metavar="DIR", help="keep (and reuse) the synthetic files in DIR")
    args = parser.parse_args()
    if args.synthetic_gb:
        synthetic_mode(args)
    else:
        corpus_mode(args)


if __name__ == "__main__":
    main()
