"""The GPT: one decoder-only transformer with two block styles, read top to bottom.

- `gpt2`:  learned positional embedding, LayerNorm (with bias), GELU MLP, biases in every linear.
- `llama`: rotary positions (RoPE), RMSNorm, SwiGLU MLP, grouped-query attention, no biases.

Both share the same skeleton (token embedding -> N pre-norm blocks -> final norm -> tied lm_head)
and the same attention, `CausalSelfAttention`, which calls PyTorch's fused
`F.scaled_dot_product_attention`. Names follow one rule so that the mapping onto Hugging Face's
`GPT2LMHeadModel` / `LlamaForCausalLM` (see `gptcore.hf`) is a short table: `qkv` is the fused
query/key/value projection, `proj` is whichever linear writes back into the residual stream.

With `model.mup_base_width` set, the model is in µP (see `gptcore.mup`): the init of the block
linears and the logit multiplier change with the width multiplier m; at m = 1 it is this model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptcore.config import ModelConfig
from gptcore.data import IGNORE_INDEX


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding.

    With a cache, each new token costs one position of compute instead of re-running the whole
    prefix. Buffers are allocated on first use with the dtype/device of the keys (so bf16 under
    autocast) and hold `max_len` positions; `length` is how many are filled.
    """

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k: list[Tensor | None] = [None] * n_layer
        self.v: list[Tensor | None] = [None] * n_layer

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H_kv, T, D) keys/values at the current position; return all keys/values so far."""
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} were asked for")
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k[layer] = k.new_zeros(shape)
            self.v[layer] = v.new_zeros(shape)
        cache_k, cache_v = self.k[layer], self.v[layer]
        cache_k[:, :, start:end] = k
        cache_v[:, :, start:end] = v
        return cache_k[:, :, :end], cache_v[:, :, :end]


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables (max_positions, head_dim) for RoPE in the rotate-half layout of HF Llama.

    Frequency i pairs channel i with channel i + head_dim/2 (not adjacent channels, as in the
    original paper), so weights copy to and from `LlamaForCausalLM` without any permutation.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, D) queries or keys by their position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; grouped-query when n_kv_head < n_head.

    One fused `qkv` linear produces n_head query heads and n_kv_head key/value heads; each group
    of n_head/n_kv_head query heads shares one key/value head (SDPA's `enable_gqa`), which shrinks
    the KV cache by that factor.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # index into the KV cache
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        bias = cfg.style == "gpt2"
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv_cache: KVCache | None = None
    ) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        # Masking: without a cache (or on a fresh one) queries and keys cover the same positions,
        # so SDPA's built-in causal mask is right. One new token may see every cached key: no
        # mask. Several new tokens after a non-empty cache need an explicit, offset causal mask.
        past = kv_cache.length if kv_cache is not None else 0
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        mask = None
        if past and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=past == 0,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """GPT-2's MLP: d_model -> d_ff -> d_model with tanh-approximated GELU (as in GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Llama's MLP: proj(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm with bias for gpt2, RMSNorm for llama."""
    if cfg.style == "gpt2":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg) if cfg.style == "gpt2" else SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv_cache: KVCache | None = None
    ) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope, kv_cache))
        return x + self.drop(self.mlp(self.norm2(x)))


LOSS_CHUNK_LOGITS = 2**20  # logits per chunk of the training loss: 4 MB in fp32, cache-sized on a CPU
LOSS_MAX_CHUNKS = 16  # a compiled step unrolls the chunk loop: keep it short


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of the logits `hidden @ weight.T` (rows, vocab) against `targets`,
    with both gradients computed in the forward, over row chunks.

    The plain path sends vocab-wide tensors through memory several times: the logits, their fp32
    copy and log-softmax, and in the backward the gradient of each. Here each chunk of logits,
    read once in fp32, gives its loss and at once its gradient, softmax - one_hot (the loss is a
    sum, so that is the gradient up to the scalar the backward brings), which goes into the
    gradients of `hidden` and `weight` while the chunk is still in cache; the backward only scales
    them. Matmuls run in the ambient autocast dtype as in the plain path; the logsumexp and the
    sum of the weight's gradient are fp32. Rows whose target is IGNORE_INDEX add nothing.
    Returns (loss sum, logits): the logits, for callers that read them, carry no gradient.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, grads: bool) -> tuple[Tensor, Tensor]:
        logits = hidden @ weight.t()
        chunks = max(1, min(LOSS_MAX_CHUNKS, logits.numel() // LOSS_CHUNK_LOGITS))
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        total = hidden.new_zeros((), dtype=torch.float32)
        for z, h, t, gh in zip(
            *(x.chunk(chunks) for x in (logits, hidden, targets, grad_hidden)), strict=True
        ):
            z = z.float()
            keep = t != IGNORE_INDEX
            t = t.masked_fill(~keep, 0)[:, None]
            lse = z.logsumexp(dim=-1, keepdim=True)
            total = total + ((lse - z.gather(1, t)).squeeze(1) * keep).sum()
            if not grads:  # no_grad (evaluation): the loss only
                continue
            grad = (z - lse).exp_().scatter_add_(1, t, -torch.ones_like(lse)).mul_(keep[:, None])
            grad = grad.to(logits.dtype)
            gh.copy_(grad @ weight)
            grad_weight += grad.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logits)
        return total, logits

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_logits: Tensor) -> tuple[Tensor, Tensor, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None


class GPT(nn.Module):
    """Decoder-only language model; `cfg.style` picks the gpt2 or llama block (see module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.d_model) if cfg.style == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix reads and writes tokens
        # µP's output multiplier (mup_output_mult / m) on the final hidden state (gptcore.mup); None: off.
        self.logit_mult = cfg.mup_output_mult / cfg.width_mult if cfg.mup_base_width else None
        if cfg.style == "llama":
            cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.max_positions, cfg.rope_theta)
            # Not persistent: derived from the config, so checkpoints hold parameters only.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, and every `proj` (a write into the residual
        stream) scaled by 1/sqrt(2*n_layer) so the residual's variance stays ~constant with depth.
        PyTorch's default init with tied embeddings trains badly on small GPTs.

        Under µP the block linears (the hidden matrices) get std / sqrt(m) on top, depth factor
        included; embeddings, norms and biases keep theirs (gptcore.mup)."""
        hidden_std = 0.02 / math.sqrt(self.cfg.width_mult)  # 0.02 with µP off
        hidden = {id(m) for block in self.blocks for m in block.modules() if isinstance(m, nn.Linear)}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = hidden_std if id(module) in hidden else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=hidden_std / math.sqrt(2 * self.cfg.n_layer))

    def _hidden(self, idx: Tensor, kv_cache: KVCache | None = None) -> Tensor:
        """Token ids (B, T) -> final normed hidden states (B, T, d_model)."""
        T = idx.size(1)
        start = kv_cache.length if kv_cache is not None else 0
        if start + T > self.cfg.max_positions:
            raise ValueError(f"{start + T} positions exceed model.max_positions={self.cfg.max_positions}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start, start + T, device=idx.device))
        rope = None
        if self.cfg.style == "llama":
            rope = (self.rope_cos[start : start + T], self.rope_sin[start : start + T])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
        return self.norm_f(x)

    def _head_input(self, hidden: Tensor) -> Tensor:
        """What the tied readout reads: under µP hidden x mup_output_mult / m (the same as scaling
        the logits, as the head is linear)."""
        return hidden if self.logit_mult is None else hidden * self.logit_mult

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, kv_cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, vocab) and, given targets, the mean cross-entropy.

        `targets` are already shifted by the loader (targets[:, t] is the token after idx[:, t]).
        The mean is over the targets that are not IGNORE_INDEX (SFT skips prompt tokens), and is 0
        when every target is skipped. The loss is computed in fp32 even under bf16 autocast, by
        `LinearCrossEntropy`; the logits it returns beside the loss carry no gradient.
        """
        x = self._head_input(self._hidden(idx, kv_cache))
        if targets is None:
            return self.lm_head(x), None
        weight, flat = self.lm_head.weight, x.reshape(-1, x.size(-1))
        grads = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
        total, logits = LinearCrossEntropy.apply(flat, weight, targets.reshape(-1), grads)
        return logits.view(*idx.shape, -1), total / (targets != IGNORE_INDEX).sum().clamp_min(1)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
    ) -> Tensor:
        """Extend `idx` (B, T) by up to `max_new_tokens` sampled tokens; returns (B, T + n).

        temperature 0 is greedy; top_k > 0 keeps the k likeliest tokens; top_p < 1 keeps the
        smallest set whose probability reaches p. With `stop_token` (an id, e.g. <|endoftext|>),
        a row that emits it is padded with it and generation stops once every row has. The cache
        is used while the sequence fits in max_positions; past that (and with use_cache=False)
        each step re-runs the last max_positions tokens, so both paths give the same tokens.
        Runs in eval mode (no dropout) and restores the caller's mode. A `generator` must live on
        idx's device.
        """
        was_training = self.training
        self.eval()
        max_pos = self.cfg.max_positions
        cache = KVCache(self.cfg.n_layer, min(max_pos, idx.size(1) + max_new_tokens)) if use_cache else None
        finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= max_pos:
                hidden = self._hidden(idx[:, cache.length :], cache)  # the prompt, then 1 token
            else:
                hidden = self._hidden(idx[:, -max_pos:])
            logits = self.lm_head(self._head_input(hidden[:, -1, :])).float()
            next_id = sample(logits, temperature, top_k, top_p, generator)
            if stop_token is not None:
                next_id = next_id.masked_fill(finished, stop_token)
                finished |= next_id == stop_token
            idx = torch.cat((idx, next_id[:, None]), dim=1)
            if stop_token is not None and bool(finished.all()):
                break
        self.train(was_training)
        return idx

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, the tied embedding/lm_head matrix once.

        non_embedding=True leaves out the token and position tables (Kaplan et al.'s N); the tied
        lm_head goes with them since it is the same matrix.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B style:

            6 * N  +  12 * n_layer * d_model * seq_len

        N counts every weight a token's activations are multiplied by: the non-embedding
        parameters plus the lm_head (vocab * d_model; tied, but still a matmul). Each weight costs
        2 FLOPs (multiply + add) forward and 4 backward. The second term is attention itself:
        q.k and attn.v are 2*seq_len*d_model FLOPs each per layer forward, x3 with backward; it
        counts the full T x T score matrix (no discount for the causal mask), as PaLM and nanoGPT
        do, so MFU figures stay comparable with theirs. Norms, softmax and embeddings' lookups
        are ignored.
        """
        T = self.cfg.seq_len if seq_len is None else seq_len
        return 6.0 * self.matmul_params() + 12.0 * self.cfg.n_layer * self.cfg.d_model * T

    def matmul_params(self) -> int:
        """The weights a token's activations are multiplied by: the non-embedding parameters
        plus the lm_head (tied to the embedding, but still a matmul). The N of `flops_per_token`,
        and of `gptrun scale`'s scaling laws."""
        return self.num_params(non_embedding=True) + self.cfg.vocab_size * self.cfg.d_model


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token id per row of (B, vocab) logits; see `GPT.generate` for the knobs."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach p (the top one always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
