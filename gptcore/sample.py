"""`gptrun sample`: load a checkpoint and its tokenizer, continue a prompt, print the text."""

from __future__ import annotations

from pathlib import Path

import torch

from gptcore.checkpoint import load_checkpoint
from gptcore.errors import UserError
from gptcore.lora import model_from_state
from gptcore.model import GPT
from gptcore.tokenizer import EOT, file_sha256, load_tokenizer
from gptcore.train import resolve_device


def load_model(checkpoint: str | Path, device: torch.device) -> tuple[GPT, dict]:
    """The model of a checkpoint (LoRA adapters merged), in eval mode, with the checkpoint's state."""
    state = load_checkpoint(checkpoint)
    return model_from_state(state).to(device).eval(), state


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
) -> str:
    """Print and return the prompt's continuation. It ends at the first <|endoftext|> (the end of
    a document in training) unless `ignore_eos`, which samples all `max_new_tokens`."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise UserError(f"--temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise UserError(f"--top-k={top_k} must be >= 0 (0 disables it)")
    torch_device = resolve_device(device)
    model, state = load_model(checkpoint, torch_device)
    tok_path = Path(tokenizer) if tokenizer else Path(state["config"]["data"]["dir"]) / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    if file_sha256(tok_path) != state["tokenizer_sha256"]:
        raise UserError(
            f"tokenizer {tok_path} is not the one this checkpoint was trained with; "
            "pass the original with --tokenizer"
        )
    eot = tok.token_to_id(EOT)
    ids = tok.encode(prompt).ids if prompt else [eot]
    idx = torch.tensor([ids], dtype=torch.long, device=torch_device)
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    out = model.generate(
        idx,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        use_cache=use_cache,
        stop_token=None if ignore_eos else eot,
    )
    text = tok.decode(out[0].tolist(), skip_special_tokens=True)
    print(text)
    return text
