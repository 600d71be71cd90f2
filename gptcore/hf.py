"""Map a `gptcore.model.GPT` onto Hugging Face `GPT2LMHeadModel` / `LlamaForCausalLM`.

Used for numerical parity tests and as the core of `gptrun export`. `transformers` is an optional
extra: only `build_hf_model` imports it, lazily.

The mapping is mechanical because the model was laid out for it:
- gpt2: HF keeps the fused `c_attn` but stores linears as `Conv1D` (weight is (in, out)), so every
  linear weight is transposed; the fused qkv order (q | k | v) is the same.
- llama: the fused `qkv` is split into q_proj / k_proj / v_proj; RoPE already uses HF's
  rotate-half layout, so no rows are permuted.
- µP (gptcore.mup): HF's classes have no logit multiplier, and the head is tied to the input
  embedding, so 1/m cannot go into the shared matrix. It goes into the final norm instead: the
  logits are linear in the final norm's output, so its gain (and bias) times 1/m gives exactly
  the logits / m. µP's attention scale is today's 1/sqrt(d_head) (d_head is fixed across widths),
  so nothing else changes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from gptcore.errors import UserError
from gptcore.model import GPT


def to_hf_state_dict(model: GPT) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config kwargs for GPT2Config/LlamaConfig, state dict with HF parameter names).

    Tensors are detached copies, so the result can be saved while the model keeps training.
    Token ids (bos/eos/pad) are left unset: they belong to the tokenizer, which export adds.
    """
    cfg = model.cfg
    sd: dict[str, Tensor] = {}

    def put(name: str, tensor: Tensor, transpose: bool = False) -> None:
        tensor = tensor.detach()
        sd[name] = (tensor.t() if transpose else tensor).contiguous().clone()

    def put_final_norm(name: str, tensor: Tensor) -> None:
        """The final norm's gain or bias, with µP's logit multiplier folded in."""
        put(name, tensor if model.logit_mult is None else tensor * model.logit_mult)

    if cfg.style == "gpt2":
        if cfg.n_kv_head != cfg.n_head:
            raise UserError(
                f"model.n_kv_head={cfg.n_kv_head} != model.n_head={cfg.n_head}: "
                "GPT2LMHeadModel has no grouped-query attention; export a llama-style "
                "model or set n_kv_head = n_head"
            )
        kwargs: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_positions,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.d_ff,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
        )
        put("transformer.wte.weight", model.tok_emb.weight)
        put("transformer.wpe.weight", model.pos_emb.weight)
        for i, block in enumerate(model.blocks):
            pre = f"transformer.h.{i}."
            for ours, theirs in ((block.norm1, "ln_1"), (block.norm2, "ln_2")):
                put(pre + theirs + ".weight", ours.weight)
                put(pre + theirs + ".bias", ours.bias)
            for ours, theirs in (
                (block.attn.qkv, "attn.c_attn"),
                (block.attn.proj, "attn.c_proj"),
                (block.mlp.fc, "mlp.c_fc"),
                (block.mlp.proj, "mlp.c_proj"),
            ):
                put(pre + theirs + ".weight", ours.weight, transpose=True)
                put(pre + theirs + ".bias", ours.bias)
        put_final_norm("transformer.ln_f.weight", model.norm_f.weight)
        put_final_norm("transformer.ln_f.bias", model.norm_f.bias)
    else:
        head_dim = cfg.d_model // cfg.n_head
        kwargs = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_head,
            head_dim=head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.max_positions,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,  # transformers 5 turns it into rope_parameters
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=cfg.dropout,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
        )
        put("model.embed_tokens.weight", model.tok_emb.weight)
        q_size, kv_size = cfg.n_head * head_dim, cfg.n_kv_head * head_dim
        for i, block in enumerate(model.blocks):
            pre = f"model.layers.{i}."
            put(pre + "input_layernorm.weight", block.norm1.weight)
            put(pre + "post_attention_layernorm.weight", block.norm2.weight)
            q, k, v = block.attn.qkv.weight.split([q_size, kv_size, kv_size], dim=0)
            put(pre + "self_attn.q_proj.weight", q)
            put(pre + "self_attn.k_proj.weight", k)
            put(pre + "self_attn.v_proj.weight", v)
            put(pre + "self_attn.o_proj.weight", block.attn.proj.weight)
            put(pre + "mlp.gate_proj.weight", block.mlp.gate.weight)
            put(pre + "mlp.up_proj.weight", block.mlp.up.weight)
            put(pre + "mlp.down_proj.weight", block.mlp.proj.weight)
        put_final_norm("model.norm.weight", model.norm_f.weight)
    emb_key = "transformer.wte.weight" if cfg.style == "gpt2" else "model.embed_tokens.weight"
    sd["lm_head.weight"] = sd[emb_key]  # tied: the same tensor as the token embedding
    return kwargs, sd


def build_hf_model(model: GPT, attn_implementation: str = "sdpa") -> nn.Module:
    """A `GPT2LMHeadModel` or `LlamaForCausalLM` (eval mode, fp32) holding `model`'s weights.

    Built offline from a config, so nothing is downloaded. Raises UserError when `transformers`
    is not installed.
    """
    try:
        import transformers
    except ImportError:
        raise UserError("Hugging Face support needs transformers: pip install 'gptrun[hf]'") from None
    kwargs, sd = to_hf_state_dict(model)
    if model.cfg.style == "gpt2":
        config = transformers.GPT2Config(**kwargs, attn_implementation=attn_implementation)
        hf_model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(**kwargs, attn_implementation=attn_implementation)
        hf_model = transformers.LlamaForCausalLM(config)
    hf_model.load_state_dict(sd, strict=True)
    return hf_model.float().eval()
