"""`gptrun sample`: load a checkpoint and its tokenizer, continue a prompt or answer a chat.

Plain sampling continues the text and stops at <|endoftext|> (the end of a training document).
Chat sampling renders the conversation with the ChatML template, generates the assistant's turn,
stops at <|im_end|> and prints that reply alone; the interactive mode reads the user's turns from
stdin and keeps the conversation, dropping its oldest exchanges when it outgrows the model.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

import torch
from tokenizers import Tokenizer

from gptcore.checkpoint import load_checkpoint
from gptcore.device import resolve_device
from gptcore.errors import UserError
from gptcore.lora import model_from_state
from gptcore.model import GPT
from gptcore.tokenizer import EOT, IM_END, file_sha256, load_tokenizer, render_chat, require_chat_tokens

Message = dict[str, str]


def load_model(checkpoint: str | Path, device: torch.device) -> tuple[GPT, dict]:
    """The model of a checkpoint (LoRA adapters merged), in eval mode, with the checkpoint's state."""
    state = load_checkpoint(checkpoint)
    return model_from_state(state).to(device).eval(), state


def checkpoint_tokenizer(state: dict, tokenizer: str | Path | None) -> tuple[Tokenizer, str]:
    """The tokenizer a checkpoint was trained with, and where it came from (for messages):
    `tokenizer` if given, else the copy the checkpoint carries, else (a checkpoint written before
    checkpoints carried one) the one in its data folder. Refused unless its sha256 is the one the
    checkpoint recorded: another tokenizer maps ids to other text."""
    carried = state.get("tokenizer_json")
    if carried is not None and not tokenizer:
        if hashlib.sha256(carried.encode("utf-8")).hexdigest() != state["tokenizer_sha256"]:
            raise UserError(
                "the tokenizer this checkpoint carries is not the one it recorded (sha256 differs); "
                "pass the original tokenizer.json with --tokenizer"
            )
        return Tokenizer.from_str(carried), "of the checkpoint"
    path = Path(tokenizer) if tokenizer else Path(state["config"]["data"]["dir"]) / "tokenizer.json"
    if not tokenizer and not path.is_file():
        raise UserError(
            f"this checkpoint carries no tokenizer (it predates that) and {path}, its data folder's, "
            "is not found; pass the tokenizer.json it was trained with: --tokenizer PATH"
        )
    tok = load_tokenizer(path)
    if file_sha256(path) != state["tokenizer_sha256"]:
        raise UserError(
            f"tokenizer {path} is not the one this checkpoint was trained with; "
            "pass the original with --tokenizer"
        )
    return tok, str(path)


class Sampler:
    """A model and its tokenizer with the sampling knobs: a prompt in, the model's text out."""

    def __init__(
        self,
        model: GPT,
        tok: Tokenizer,
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        use_cache: bool,
    ) -> None:
        self.model, self.tok = model, tok
        self.device = model.tok_emb.weight.device
        self.knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, use_cache=use_cache)
        self.max_new_tokens = max_new_tokens
        # One generator for the whole session: each reply of a chat draws new random numbers.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def new_tokens(self, ids: list[int], stop: int | None) -> list[int]:
        """The ids generated after `ids`, ending with `stop` if the model emitted it."""
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model.generate(
            idx, self.max_new_tokens, generator=self.generator, stop_token=stop, **self.knobs
        )
        return out[0, len(ids) :].tolist()

    def continue_text(self, prompt: str, ignore_eos: bool) -> str:
        """The prompt and its continuation (from the start of a document if the prompt is empty)."""
        eot = self.tok.token_to_id(EOT)
        ids = self.tok.encode(prompt).ids if prompt else [eot]
        new = self.new_tokens(ids, None if ignore_eos else eot)
        return self.tok.decode(ids + new, skip_special_tokens=True)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The chat template's tokens for `messages`, up to the assistant's turn to speak."""
        return self.tok.encode(render_chat(messages, add_generation_prompt=True)).ids

    def reply(self, messages: list[Message]) -> str:
        """The assistant's next turn: generated up to its <|im_end|>, which is not part of it."""
        im_end = self.tok.token_to_id(IM_END)
        new = self.new_tokens(self.prompt_ids(messages), im_end)
        if im_end in new:
            new = new[: new.index(im_end)]
        return self.tok.decode(new, skip_special_tokens=True)

    def history_limit(self) -> int:
        """Prompt tokens a conversation may take: the model's positions less room for the reply
        (`max_new_tokens`, but at most half the positions, so that a prompt always fits)."""
        positions = self.model.cfg.max_positions
        return positions - min(self.max_new_tokens, positions // 2)


def fit_history(sampler: Sampler, system: list[Message], turns: list[Message]) -> list[Message]:
    """The latest `turns` (user, assistant, ..., user) whose prompt, after the system message,
    fits `sampler.history_limit()`: whole exchanges are dropped from the oldest. The last user
    turn always stays; if it alone is too long, generation sees its last positions only."""
    limit = sampler.history_limit()
    while len(turns) > 1 and len(sampler.prompt_ids(system + turns)) > limit:
        turns = turns[2:]
    return turns


def chat_loop(sampler: Sampler, lines: Iterable[str], system: str | None, out: TextIO) -> list[str]:
    """Answer each non-empty line as a user turn, printing each reply to `out`; ends when `lines`
    does. Returns the replies."""
    head = _system(system)
    turns: list[Message] = []
    replies = []
    for line in lines:
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        turns = fit_history(sampler, head, [*turns, {"role": "user", "content": text}])
        replies.append(sampler.reply(head + turns))
        turns.append({"role": "assistant", "content": replies[-1]})
        print(replies[-1], file=out, flush=True)
    return replies


def _system(system: str | None) -> list[Message]:
    return [{"role": "system", "content": system}] if system else []


def _user_lines(stream: TextIO) -> Iterator[str]:
    """Lines of `stream`, with a `> ` prompt on stderr when a person is typing them."""
    typing = stream.isatty()
    while True:
        if typing:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        yield line


def _check_options(
    prompt: str,
    temperature: float,
    top_k: int,
    top_p: float,
    max_new_tokens: int,
    *,
    chat: bool,
    system: str | None,
    interactive: bool,
    ignore_eos: bool,
) -> None:
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise UserError(f"--temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise UserError(f"--top-k={top_k} must be >= 0 (0 disables it)")
    if not chat:
        for flag, given in (("system", system), ("interactive", interactive)):
            if given:
                raise UserError(f"--{flag} is for chat sampling; add --chat")
        return
    if ignore_eos:
        raise UserError("--ignore-eos is for plain sampling; a chat reply ends at <|im_end|>")
    if interactive and prompt:
        raise UserError("--prompt with --interactive: type the user's turns on stdin instead")
    if not interactive and not prompt:
        raise UserError("--chat needs --prompt TEXT (the user's message) or --interactive")


def sample_cli(
    checkpoint: str,
    *,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    use_cache: bool,
    tokenizer: str | None,
    device: str,
    ignore_eos: bool = False,
    chat: bool = False,
    system: str | None = None,
    interactive: bool = False,
) -> str:
    """Print and return what the model writes. Plain: the prompt's continuation, ending at the
    first <|endoftext|> unless `ignore_eos` (then all `max_new_tokens`). `chat`: the assistant's
    reply to `prompt` (after `system`, if given), ending at <|im_end|>. `interactive`: a chat whose
    user turns are the lines of stdin, one reply printed per line until EOF; returns the replies,
    one per line."""
    _check_options(
        prompt,
        temperature,
        top_k,
        top_p,
        max_new_tokens,
        chat=chat,
        system=system,
        interactive=interactive,
        ignore_eos=ignore_eos,
    )
    model, state = load_model(checkpoint, resolve_device(device, "--device"))
    tok, tok_source = checkpoint_tokenizer(state, tokenizer)
    if chat:
        require_chat_tokens(tok, tok_source)
    sampler = Sampler(
        model,
        tok,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        use_cache=use_cache,
    )
    if interactive:
        return "\n".join(chat_loop(sampler, _user_lines(sys.stdin), system, sys.stdout))
    if chat:
        text = sampler.reply([*_system(system), {"role": "user", "content": prompt}])
    else:
        text = sampler.continue_text(prompt, ignore_eos)
    print(text)
    return text
