"""SFT conversations: read and check chat JSONL, tokenize with the chat template, mark the tokens
the loss is on, and the built-in toy conversation set.

A conversation is `{"conversations": [{"role": "system|user|assistant", "content": "..."}, ...]}`,
one per JSONL line. It is rendered with `render_chat` (ChatML, `<|im_start|>role\\n...<|im_end|>\\n`)
and tokenized in one piece, exactly as `gptrun sample --chat` tokenizes a prompt; the loss mask then
marks the tokens of each assistant turn's content and its `<|im_end|>`, the tokens the model must
learn to write. Everything else (system and user turns, the role headers) is context only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tokenizers import Tokenizer

from gptcore.errors import UserError
from gptcore.tokenizer import IM_END, IM_START, render_chat

ROLES = ("system", "user", "assistant")
Conversation = list[dict[str, str]]


MAX_LINE_BYTES = 1 << 20  # a longer conversation line is skipped, never read whole (see below)


def read_conversations(path: Path, overlong: list[str]) -> Iterator[Conversation]:
    """The conversations of a chat JSONL file, each checked; a bad line raises a UserError that
    names the file and line.

    A line over MAX_LINE_BYTES (1 MiB, some 300k tokens) is skipped a chunk at a time and its
    `path:line` appended to `overlong`: training sees at most a window of `model.seq_len` tokens
    from a conversation's start, and tokenizing a 32 MB line once took 5 GB of memory."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, errors need the line number
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None
    with f:
        for number, line in enumerate(_bounded_lines(f, MAX_LINE_BYTES), start=1):
            if line is None:
                overlong.append(f"{path}:{number}")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{number} is not UTF-8; convert the file to UTF-8") from None
            if text.strip():
                yield check_conversation(_parse(text, path, number), f"{path}:{number}")


def _bounded_lines(f: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Each line of a binary file (its newline excluded), or None for one longer than `limit`
    bytes, which is read past `limit` bytes at a time."""
    while line := f.readline(limit + 1):
        if line.endswith(b"\n"):
            yield line[:-1]
        elif len(line) <= limit:  # the last line, without a newline
            yield line
        else:
            while (rest := f.readline(limit)) and not rest.endswith(b"\n"):
                pass
            yield None


def _parse(line: str, path: Path, number: int) -> object:
    try:
        return json.loads(line)
    except ValueError as err:
        raise UserError(
            f"{path}:{number} is not JSON ({err.msg}); each line must be one conversation"
        ) from None


def check_conversation(record: object, where: str) -> Conversation:
    """The messages of one record, or a UserError naming what is wrong and where."""
    shape = 'expected {"conversations": [{"role": ..., "content": ...}, ...]}'
    messages = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: no conversation; {shape}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i} has no text content; {shape}")
        if m.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn, so nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_conversations(
    tok: Tokenizer, conversations: list[Conversation]
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per conversation; mask 1 on assistant content and its <|im_end|>."""
    texts, spans = [], []
    for messages in conversations:
        texts.append(render_chat(messages))
        spans.append(_assistant_spans(messages))
    out = []
    for encoding, learn in zip(tok.encode_batch(texts, add_special_tokens=False), spans, strict=True):
        starts = np.array([start for start, _ in encoding.offsets])
        mask = np.zeros(len(starts), dtype=bool)
        for begin, end in learn:
            mask |= (starts >= begin) & (starts < end)
        out.append((encoding.ids, mask.tolist()))
    return out


def _assistant_spans(messages: Conversation) -> list[tuple[int, int]]:
    """Character spans of render_chat's text covering each assistant content + <|im_end|>."""
    spans, pos = [], 0
    for m in messages:
        header = f"{IM_START}{m['role']}\n"
        content_start = pos + len(header)
        end = content_start + len(m["content"]) + len(IM_END)
        if m["role"] == "assistant":
            spans.append((content_start, end))
        pos = end + 1  # the "\n" after <|im_end|>
    return spans


# ---------------------------------------------------------------- the built-in toy set
TOY_SYSTEM = "You continue speeches from Shakespeare's plays."
_SPEAKER_LINE = re.compile(r"^([A-Z][A-Za-z' .-]*):$")
TOY_MAX_LINES = 6  # the assistant continues with at most this many lines (fits a 128-token window)


def toy_conversations(scenes: Iterator[str]) -> Iterator[Conversation]:
    """A toy SFT set, deterministic, from the scenes of the built-in Shakespeare corpus: the user
    names a speaker and gives the first line of a speech, the assistant continues the speech.
    It teaches the chat format and the turn-taking, not conversation."""
    for scene in scenes:
        play = scene.split("\n", 1)[0]
        for speaker, lines in _speeches(scene):
            if len(lines) < 2:
                continue
            yield [
                {"role": "system", "content": TOY_SYSTEM},
                {"role": "user", "content": f"{speaker.title()} in {play}: {lines[0]}"},
                {"role": "assistant", "content": "\n".join(lines[1 : 1 + TOY_MAX_LINES])},
            ]


def _speeches(scene: str) -> Iterator[tuple[str, list[str]]]:
    """(speaker, lines) for each speech: a "NAME:" line, then lines up to a blank one."""
    speaker, lines = None, []
    for line in scene.splitlines() + [""]:
        match = _SPEAKER_LINE.match(line)
        if match:
            speaker, lines = match.group(1), []
        elif line and speaker:
            lines.append(line)
        elif speaker:
            yield speaker, lines
            speaker = None
