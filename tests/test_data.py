"""The loader: deterministic, resumable, DDP-exact batches from memory-mapped shards."""

from __future__ import annotations

import gc
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from gptcore import data as data_module
from gptcore.data import Prefetcher, TokenData
from gptcore.errors import UserError

SEQ = 8


def write_data(root: Path, train: list[np.ndarray], val: list[np.ndarray]) -> Path:
    """A data folder as prepare writes it, with chosen shard contents."""
    splits = {}
    for split, shards in (("train", train), ("val", val)):
        (root / split).mkdir(parents=True)
        names = []
        for i, shard in enumerate(shards):
            names.append(f"{split}/shard_{i:05d}.npy")
            np.save(root / names[-1], shard.astype(np.uint16))
        tokens = sum(len(s) for s in shards)
        splits[split] = {"tokens": tokens, "bytes": 3 * tokens, "documents": 1, "shards": names}
    meta = {
        "format_version": 1,
        "tokenizer_sha256": "ab" * 32,
        "vocab_size": 65535,
        "eot_id": 0,
        "splits": splits,
        "bytes_per_token": 3.0,
        "sources": [],
        "options": {},
        "fingerprint": "x",
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.fixture
def data(tmp_path: Path) -> TokenData:
    """Train shards hold distinct, position-encoding values so windows can be traced back:
    value = 10000 * shard + position. Shard 1 is too short for any window."""
    train = [10000 * k + np.arange(n) for k, n in enumerate((50, SEQ, 120, 31))]
    val = [np.arange(40) + 50000, np.arange(25) + 60000]
    return TokenData(write_data(tmp_path / "d", train, val))


def batch(data: TokenData, **kw: int) -> tuple[torch.Tensor, torch.Tensor]:
    args = {
        "seed": 0,
        "step": 0,
        "micro": 0,
        "rank": 0,
        "world_size": 1,
        "batch_size": 4,
        "grad_accum": 1,
        "seq_len": SEQ,
        **kw,
    }
    return data.train_batch(**args)


def test_meta_fields(data: TokenData) -> None:
    assert data.vocab_size == 65535 and data.eot_id == 0 and data.tokenizer_sha256 == "ab" * 32


def test_format_constants_and_cache_dir_have_one_definition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptcore import autocompile, config, corpora, measured, prepare, tokenizer

    assert data_module.VOCAB_LIMIT == 65536  # uint16 holds ids 0..65535
    assert prepare.VOCAB_LIMIT is tokenizer.VOCAB_LIMIT is config.VOCAB_LIMIT is data_module.VOCAB_LIMIT
    assert prepare.FORMAT_VERSION is data_module.FORMAT_VERSION
    assert corpora.cache_dir is measured.cache_dir is autocompile.cache_dir is data_module.cache_dir
    monkeypatch.setenv("GPTRUN_CACHE_DIR", str(tmp_path))
    assert data_module.cache_dir() == tmp_path
    tokenizer.check_vocab_size(65536)  # the largest vocabulary uint16 shards hold
    config.ModelConfig(vocab_size=65536).validate()
    for too_large in (
        lambda: tokenizer.check_vocab_size(65537),
        lambda: config.ModelConfig(vocab_size=65537).validate(),
    ):
        with pytest.raises(UserError, match="65536"):
            too_large()


def test_batches_are_deterministic_and_shifted(data: TokenData) -> None:
    x, y = batch(data, seed=3, step=7)
    x2, y2 = batch(data, seed=3, step=7)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, batch(data, seed=3, step=8)[0])
    assert not torch.equal(x, batch(data, seed=4, step=7)[0])


def test_windows_lie_inside_one_shard_and_cover_all_starts(data: TokenData) -> None:
    seen = set()
    for step in range(300):
        x, y = batch(data, step=step, batch_size=8)
        window = torch.cat([x, y[:, -1:]], dim=1)
        shard, pos = window // 10000, window % 10000
        assert (shard == shard[:, :1]).all(), "a window crosses a shard boundary"
        assert (pos == pos[:, :1] + torch.arange(SEQ + 1)).all()
        assert not (shard == 1).any(), "shard 1 has no room for a window"
        seen.update(zip(shard[:, 0].tolist(), pos[:, 0].tolist(), strict=True))
    expected = {(k, p) for k, n in ((0, 50), (2, 120), (3, 31)) for p in range(n - SEQ)}
    assert seen == expected  # every valid start is reachable, and only those


def test_ddp_and_grad_accum_slice_one_global_draw(data: TokenData) -> None:
    """2 workers x batch B == 1 worker x batch 2B; accum micro-steps partition it too."""
    for step in range(5):
        full, _ = batch(data, step=step, batch_size=8)
        r0, _ = batch(data, step=step, batch_size=4, rank=0, world_size=2)
        r1, _ = batch(data, step=step, batch_size=4, rank=1, world_size=2)
        assert torch.equal(torch.cat([r0, r1]), full)
        micro = [
            batch(data, step=step, batch_size=2, grad_accum=2, world_size=2, micro=m, rank=r)[0]
            for m in range(2)
            for r in range(2)
        ]
        assert torch.equal(torch.cat(micro), full)


def prefetcher(data: TokenData, grad_accum: int = 2) -> tuple[Prefetcher, list[tuple[int, int]]]:
    """A CPU prefetcher of `data`'s batches (batch 2 per micro-step), and the keys it built, in order."""
    built: list[tuple[int, int]] = []

    def make(*, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        built.append((step, micro))
        return batch(data, step=step, micro=micro, batch_size=2, grad_accum=grad_accum)

    return Prefetcher(make, grad_accum, torch.device("cpu")), built


def test_prefetcher_returns_the_synchronous_batches_after_any_jump(data: TokenData) -> None:
    """A run's reads in order, then what a resume, a rollback and a timing step ask for: a batch
    read again, a jump back, a jump ahead. Every answer is the batch the synchronous path builds."""
    ahead, _ = prefetcher(data)
    reads = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 0), (0, 1), (1, 0), (7, 0), (7, 1), (3, 1), (4, 0)]
    for step, micro in reads:
        want = batch(data, step=step, micro=micro, batch_size=2, grad_accum=2)
        got = ahead.get(step, micro)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (step, micro)


def test_prefetcher_builds_the_next_batches_before_they_are_asked_for(data: TokenData) -> None:
    ahead, built = prefetcher(data)
    ahead.get(0, 0)
    for future in ahead.queued.values():
        future.result()  # the thread builds them without another get
    assert built == [(0, 0), (0, 1), (1, 0)]
    ahead.get(0, 1)  # predicted: nothing built on request, one more queued
    ahead.queued[(1, 1)].result()
    assert built == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_prefetcher_raises_the_builders_error_to_the_reader(data: TokenData) -> None:
    ahead, _ = prefetcher(data)
    with pytest.raises(ValueError, match="micro=5 rank=0 outside grad_accum=2"):
        ahead.get(0, 5)
    assert torch.equal(ahead.get(0, 0)[0], batch(data, grad_accum=2, batch_size=2)[0])  # still serving


def test_prefetcher_thread_ends_with_its_prefetcher(data: TokenData) -> None:
    """Nothing leaks when a Trainer ends or raises: dropping the prefetcher ends its thread."""
    ahead, _ = prefetcher(data)
    ahead.get(0, 0)
    thread = ahead.thread
    assert thread.daemon and thread.is_alive()
    del ahead
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_val_windows_are_fixed_and_split_across_ranks(data: TokenData) -> None:
    # val = 40 + 25 tokens; 32 eval tokens -> (32 - 1) // 8 = 3 windows, stride 8.
    assert data.num_val_windows(SEQ, 32) == 3
    assert data.num_val_windows(SEQ, 10**9) == (65 - 1) // SEQ
    assert data.num_val_windows(SEQ, 1) == 1  # at least one window
    concat = np.concatenate([np.arange(40) + 50000, np.arange(25) + 60000])
    n = data.num_val_windows(SEQ, 10**9)
    one = [x for x, _ in data.val_batches(seq_len=SEQ, batch_size=3, eval_tokens=10**9)]
    assert [len(x) for x in one] == [3, 3, 2]
    xs = torch.cat(one)
    for i in range(n):  # consecutive windows, crossing the shard boundary where they must
        assert xs[i].tolist() == concat[i * SEQ : (i + 1) * SEQ].tolist()
    ys = torch.cat([y for _, y in data.val_batches(seq_len=SEQ, batch_size=3, eval_tokens=10**9)])
    assert torch.equal(xs[:, 1:], ys[:, :-1])
    per_rank = [
        torch.cat(
            [
                x
                for x, _ in data.val_batches(
                    seq_len=SEQ, batch_size=2, eval_tokens=10**9, rank=r, world_size=3
                )
            ]
        )
        for r in range(3)
    ]
    for r, got in enumerate(per_rank):
        assert torch.equal(got, xs[r::3])  # window i on rank i % world_size, each exactly once
    assert sum(len(g) for g in per_rank) == n


def test_pickles_as_a_path(data: TokenData) -> None:
    blob = pickle.dumps(data)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert torch.equal(batch(again, step=2)[0], batch(data, step=2)[0])


def test_too_short_splits_are_user_errors(tmp_path: Path) -> None:
    short = TokenData(write_data(tmp_path / "s", [np.arange(SEQ)], [np.arange(SEQ)]))
    with pytest.raises(UserError, match="no shard longer than seq_len"):
        batch(short)
    with pytest.raises(UserError, match="val split .* fewer than one window"):
        list(short.val_batches(seq_len=SEQ, batch_size=2, eval_tokens=100))


def test_missing_or_broken_folders_say_run_prepare(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data folder not found.*gptrun prepare"):
        TokenData(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="meta.json not found.*gptrun prepare"):
        TokenData(tmp_path / "empty")
    bad = write_data(tmp_path / "bad", [np.arange(50)], [np.arange(50)])
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON.*gptrun prepare"):
        TokenData(bad)
    lost = write_data(tmp_path / "lost", [np.arange(50)], [np.arange(50)])
    (lost / "train" / "shard_00000.npy").unlink()
    with pytest.raises(UserError, match="shard_00000.npy is missing.*gptrun prepare"):
        TokenData(lost)
