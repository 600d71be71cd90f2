"""`gptrun export --hf`: a checkpoint as a Hugging Face folder that transformers loads offline.

The folder holds `model.safetensors` + `config.json` (`GPT2LMHeadModel` for the gpt2 style,
`LlamaForCausalLM` for llama; weights mapped by `gptcore.hf`), `generation_config.json` (stops at
<|im_end|> or <|endoftext|>, pads with <|endoftext|>) and the tokenizer the checkpoint was trained
with, with its special tokens and the ChatML chat template. It is written to a temp sibling and
renamed into place, so an interrupted export leaves no half-written folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from gptcore.atomic import atomic_dir, check_writable_dir
from gptcore.errors import UserError
from gptcore.hf import build_hf_model
from gptcore.sample import checkpoint_tokenizer, load_model
from gptcore.tokenizer import CHAT_TEMPLATE, EOT, IM_END, hf_special_tokens, require_chat_tokens


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    force: bool = False,
) -> nn.Module:
    """Write the checkpoint (a `.pt` file or a Ray Train checkpoint folder) to `out` as a
    Hugging Face model folder; returns the transformers model that was saved. A non-empty `out`
    is replaced only with `force`."""
    out = Path(out)
    check_writable_dir(out, "--hf")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--hf {out} is not empty; pass --force to replace it, or give a new folder")
    model, state = load_model(checkpoint, torch.device("cpu"))
    tok, tok_source = checkpoint_tokenizer(state, tokenizer)
    require_chat_tokens(tok, tok_source)
    hf_model = build_hf_model(model)  # refuses what the HF class cannot hold (gpt2 with GQA)

    import transformers  # present: build_hf_model needs it too

    specials = hf_special_tokens(tok)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **specials,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model.cfg.max_positions,
    )
    ids = {name: tok.token_to_id(token) for name, token in specials.items()}
    for key in ("bos", "eos", "pad"):
        setattr(hf_model.config, f"{key}_token_id", ids[f"{key}_token"])
    hf_model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids["bos_token"],
        # A chat reply ends at <|im_end|>, a document at <|endoftext|>: stop at either.
        eos_token_id=[tok.token_to_id(IM_END), tok.token_to_id(EOT)],
        pad_token_id=ids["pad_token"],
    )
    with atomic_dir(out) as tmp:
        hf_model.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
    return hf_model
