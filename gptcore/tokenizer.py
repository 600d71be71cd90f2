"""Byte-level BPE tokenizer: train, save in the standard HF layout, load, and the chat template.

Byte-level BPE never needs an unknown token (every byte is in the base alphabet), so any UTF-8
text round-trips. Ids must fit the uint16 token shards, which bounds the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gptcore.data import VOCAB_LIMIT
from gptcore.errors import UserError, first_line

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Special tokens come first so that their ids (0, 1, 2) are the same in every vocabulary.
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens

# ChatML as in MiniMind: one `<|im_start|>role\ncontent<|im_end|>\n` block per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def check_vocab_size(vocab_size: int) -> None:
    """Reject sizes the shards cannot hold or that leave no room for merges."""
    if vocab_size > VOCAB_LIMIT:
        raise UserError(
            f"--vocab-size {vocab_size} is too large: token shards are uint16, so at "
            f"most {VOCAB_LIMIT}; pick a smaller vocabulary"
        )
    if vocab_size < MIN_VOCAB:
        raise UserError(
            f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least "
            f"{MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )


def train_tokenizer(
    documents: Iterable[str], vocab_size: int, progress: bool = False, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE on a stream of documents (`length`: their count, for progress)."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer.json, turning a missing or unreadable file into a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer not found: {path}; pass a tokenizer.json written by `gptrun prepare`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for any parse failure
        reason = first_line(err)
        raise UserError(
            f"{path} is not a valid tokenizer.json ({reason}); pass a tokenizer.json "
            "written by `gptrun prepare`"
        ) from None


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """The UTF-8 bytes each token id stands for (int64, one per id); special tokens count 0.

    A byte-level BPE token is one character per byte (GPT-2's byte-to-unicode map), so its byte
    count is its length: decoding one id alone would turn a token that holds part of a multi-byte
    character into U+FFFD (3 bytes). Other tokenizers (a reused --tokenizer) count the bytes of
    each token decoded alone."""
    byte_level = isinstance(tok.decoder, decoders.ByteLevel)
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for token, i in tok.get_vocab().items():
        if i not in special:
            lengths[i] = len(token) if byte_level else len(tok.decode([i]).encode("utf-8"))
    return lengths


def file_sha256(path: str | os.PathLike, hashed: Callable[[int], object] | None = None) -> str:
    """sha256 of a file's bytes, read in chunks (files may be large); `hashed(n)` after each
    chunk of n bytes, for a progress bar."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            if hashed is not None:
                hashed(len(chunk))
    return digest.hexdigest()


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json and a tokenizer_config.json (special tokens, chat template) so that
    `transformers` loads the folder with `AutoTokenizer` / `PreTrainedTokenizerFast`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tok.save(str(path))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **hf_special_tokens(tok),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def hf_special_tokens(tok: Tokenizer) -> dict[str, str]:
    """The special tokens transformers is told about, MiniMind's choice: a chat turn opens with
    <|im_start|> (bos) and ends with <|im_end|> (eos); <|endoftext|> pads, and stands in for the
    unknown token a byte-level BPE never emits. A tokenizer without the chat tokens (one reused
    with --tokenizer) falls back to <|endoftext|>."""

    def present(token: str) -> str:
        return token if tok.token_to_id(token) is not None else EOT

    return {"bos_token": present(IM_START), "eos_token": present(IM_END), "pad_token": EOT, "unk_token": EOT}


def require_chat_tokens(tok: Tokenizer, path: str | os.PathLike) -> None:
    """Refuse a tokenizer that cannot write the chat template (chat sampling, export)."""
    missing = [t for t in (IM_START, IM_END) if tok.token_to_id(t) is None]
    if missing:
        raise UserError(
            f"tokenizer {path} has no {' or '.join(missing)} token, which the chat template needs; "
            "use a tokenizer trained by gptrun prepare"
        )


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """The text CHAT_TEMPLATE renders, without needing jinja (for SFT data and sampling)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
