"""Documents from `--input` paths: .txt, .jsonl, .parquet files and folders of them.

Everything streams (generators over chunks, lines or parquet batches) so that corpora larger than
memory can be prepared. Bad input is reported as a UserError naming the file and the place in it.
"""

from __future__ import annotations

import codecs
import collections
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from gptcore.errors import UserError, first_line
from gptcore.tokenizer import EOT, file_sha256

EXTENSIONS = (".txt", ".jsonl", ".parquet")
CHUNK_BYTES = 1 << 20  # .txt files are decoded this many bytes at a time
# A .txt document longer than this is cut at a paragraph or line break: one huge file then still
# streams in bounded memory and yields enough documents for a train/val split.
MAX_DOC_CHARS = 1 << 16
PARQUET_BATCH_ROWS = 256


@dataclass(frozen=True)
class Source:
    """One input as meta.json records it, and a way to stream its documents (again)."""

    record: dict
    documents: Callable[[], Iterator[str]]
    file: Path | None = None  # an input file, whose every read must see the same bytes
    signature: tuple[int, int, int] | None = None  # the file's (size, mtime_ns, inode) when hashed

    def check_unchanged(self) -> None:
        """Refuse a file that changed since it was hashed: prepare reads it once per pass, and
        passes that see different documents would split and encode different corpora."""
        if self.file is not None and file_signature(self.file) != self.signature:
            raise self.changed()

    def changed(self) -> UserError:
        return UserError(
            f"{self.file} changed while prepare was reading it; run prepare again once nothing "
            "writes to it (nothing was written)"
        )


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is written to or replaced; None when it is gone."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def open_inputs(
    paths: Sequence[str | os.PathLike],
    text_field: str = "text",
    errors: str = "strict",
    progress: bool = False,
) -> list[Source]:
    """Check and expand `paths` (folders recursively, sorted) before anything is written, then
    hash the files (seconds per GB: a bar shows it when `progress` and stderr is a terminal)."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UserError(f"input not found: {path}; check the --input path")
        if path.is_dir():
            found = _folder_inputs(path)
            if not found:
                raise UserError(
                    f"no .txt, .jsonl or .parquet files under {path}; point --input "
                    "at a folder or files with those extensions"
                )
        elif path.suffix in EXTENSIONS:
            found = [path]
        else:
            raise UserError(
                f"unsupported input {path}: expected a .txt, .jsonl or .parquet file, or a folder of them"
            )
        files.extend(found)
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total,
        desc="hashing",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=None if progress else True,
    ) as bar:
        return [_open_file(f, text_field, errors, bar.update) for f in files]


def _folder_inputs(root: Path) -> list[Path]:
    """The input files under a folder, recursively and sorted; hidden paths (.git, ...) are left
    out. Other files are skipped too, but not silently: one line counts them by extension."""
    files: list[Path] = []
    skipped: collections.Counter[str] = collections.Counter()
    for path in sorted(root.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        if path.suffix in EXTENSIONS:
            files.append(path)
        else:
            skipped[path.suffix or "no extension"] += 1
    if skipped:
        total = sum(skipped.values())
        counts = ", ".join(f"{n} {suffix}" for suffix, n in sorted(skipped.items()))
        print(
            f"skipped {total} file{'s' * (total != 1)} under {root} that are not .txt, .jsonl "
            f"or .parquet: {counts}"
        )
    return files


def _open_file(path: Path, text_field: str, errors: str, hashed: Callable[[int], object]) -> Source:
    if path.suffix == ".parquet":
        _check_parquet(path, text_field)
        reader = functools.partial(parquet_documents, path, text_field)
    elif path.suffix == ".jsonl":
        reader = functools.partial(jsonl_documents, path, text_field, errors)
    else:
        reader = functools.partial(txt_documents, path, errors)
    signature = file_signature(path)  # before hashing: a write during it shows as a change
    record = {"path": str(path.resolve()), "sha256": file_sha256(path, hashed), "bytes": path.stat().st_size}
    return Source(record, reader, path, signature)


def _not_utf8(path: Path, offset: int, where: str = "") -> UserError:
    return UserError(
        f"{path}: not valid UTF-8 at byte {offset}{where}; fix the file or pass --errors replace"
    )


def txt_documents(path: Path, errors: str = "strict") -> Iterator[str]:
    """One document per file, split on literal `<|endoftext|>`; read CHUNK_BYTES at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
    fed = 0  # bytes handed to the decoder so far
    buf = ""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            held = len(decoder.getstate()[0])  # undecoded bytes left from the previous chunk
            try:
                buf += decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, fed - held + err.start) from None
            fed += len(chunk)
            *done, buf = buf.split(EOT)
            for doc in done:
                yield from _cut(doc)
            # Keep a tail of len(EOT) characters: it may hold the start of a separator.
            if len(buf) > MAX_DOC_CHARS + len(EOT):
                *pieces, buf = _cut(buf, keep=len(EOT))
                yield from pieces
            if not chunk:
                break
    yield from _cut(buf)


def _cut(text: str, keep: int = 0) -> list[str]:
    """Split `text` into pieces of at most MAX_DOC_CHARS, preferring paragraph, then line breaks.
    With `keep`, the last piece (returned unfinished) has more than `keep` characters."""
    pieces, start = [], 0
    while len(text) - start > MAX_DOC_CHARS + keep:
        stop = start + MAX_DOC_CHARS
        cut = text.rfind("\n\n", start, stop)
        cut = cut + 2 if cut > start else text.rfind("\n", start, stop) + 1
        if cut <= start:
            cut = stop
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def jsonl_documents(path: Path, text_field: str = "text", errors: str = "strict") -> Iterator[str]:
    """One document per line: the string in field `text_field` (null counts as empty)."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8", errors)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, offset + err.start, f" (line {lineno})") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({err.msg} at column "
                    f"{err.colno}); fix or remove the line"
                ) from None
            if not isinstance(row, dict):
                raise UserError(
                    f"{path}:{lineno}: expected a JSON object with field "
                    f"'{text_field}', got {type(row).__name__}; fix the line"
                )
            if text_field not in row:
                keys = ", ".join(map(repr, row)) or "none"
                raise UserError(
                    f"{path}:{lineno}: no field '{text_field}' (keys: {keys}); pass "
                    "--text-field with the field that holds the text"
                )
            text = row[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise UserError(
                    f"{path}:{lineno}: field '{text_field}' is a "
                    f"{type(text).__name__}, not a string; pass --text-field with "
                    "the field that holds the text"
                )
            yield _no_surrogates(text, f"{path}:{lineno}", errors)


def _no_surrogates(text: str, where: str, errors: str) -> str:
    """JSON escapes like "\\ud800" give unpaired surrogates, which are not encodable text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if errors == "strict":
            raise UserError(
                f"{where}: text has an unpaired surrogate escape (\\ud800-\\udfff); "
                "fix the line or pass --errors replace"
            ) from None
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _check_parquet(path: Path, column: str) -> None:
    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable parquet file ({first_line(err)}); check the file") from None
    if column not in schema.names:
        raise UserError(
            f"{path}: no column '{column}' (columns: {', '.join(schema.names)}); "
            "pass --text-field with the column that holds the text"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(
            f"{path}: column '{column}' has type {kind}, not string; pass "
            "--text-field with the column that holds the text"
        )


def parquet_documents(path: Path, column: str = "text") -> Iterator[str]:
    """One document per row, read PARQUET_BATCH_ROWS rows at a time (nulls count as empty).
    Pre-buffering would load every row group's column up front (the whole file), so it is off:
    memory is then bounded by one row group."""
    parquet = pq.ParquetFile(path, pre_buffer=False)
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text
