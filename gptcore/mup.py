"""µP (Maximal Update Parametrization): the learning rate found at one width is right at any width.

Under the standard parametrization (SP) the best learning rate shrinks as d_model grows, so a
sweep on a narrow proxy says little about the wide model. µP (Yang et al., "Tensor Programs V",
arXiv 2203.03466) scales init, learning rates and the output so that every layer's update moves
its activations by the same amount at every width; the optimum learning rate then stays put.
`model.mup_base_width = B` turns it on; m = d_model / B is the width multiplier, and the config's
`optim.lr` / `optim.weight_decay` are the values at width B. The form is the paper's Table 8 (the
one that works with tied embeddings), as microsoft/mup's MuReadout / MuSharedReadout and MuAdam:

- Hidden matrices (the linears inside the blocks: attention qkv and proj, MLP fc/proj, SwiGLU
  gate/up/proj): init std 0.02 / sqrt(m), the `proj` writes keeping today's depth factor
  1 / sqrt(2 n_layer); AdamW lr / m. Adam's update is ~lr per entry whatever the gradient's
  scale, and a matrix sums fan_in = m x B of them, so lr / m keeps its effect on the output the
  base width's.
- Weight decay of the hidden matrices: x m, so that lr x wd, the fraction each step decays a
  weight by (decoupled AdamW), is the base width's. This is MuAdam's rule; it keeps the decay's
  timescale (in steps) independent of width. Keeping wd fixed instead would make the decay m
  times weaker on the wide model.
- Embeddings (token, position), norm gains, biases: init and lr unchanged (one dimension grows
  with width: "vector-like").
- Output: logits x 1/m. The head is the token embedding (tied), whose entries do not shrink with
  width; summing d_model of them against a hidden state they have learned to align with grows
  like m. The multiplier is applied to the final hidden state, so the weights stay tied (and
  `gptcore.hf` folds it into the final norm's gain for export). `model.mup_output_mult` (µP's
  output_mult, default 1) scales the logits at the base width: a hyperparameter that µP
  transfers like the learning rate, worth searching on the proxy. GPT-2's init gives small
  logits (0.02 x sqrt(d_model) at init), and under SP they grow with width, which is much of
  why a wider SP model trains faster in a short run; µP keeps the base width's scale, so
  that scale is best tuned there (benchmarks/mup_transfer.py measures it).
- Attention: µP's rule is q.k / d_head rather than / sqrt(d_head), so that attention logits
  do not grow as d_head grows. Here widths grow by adding heads (d_ff and n_head scale with
  d_model, d_head is fixed, and `gptrun transfer` refuses another d_head), so the two rules differ
  by a constant, and the constant that makes the base width today's model makes it today's
  1 / sqrt(d_head) at every width: attention is unchanged.
- Depth is not scaled: µP transfers across width only.

At m = 1 (mup_base_width = d_model) every factor is 1 and the model, its init and its updates are
today's, bit for bit. LoRA adapters keep the plain lr. What µP does not transfer (depth, vocabulary,
d_head, sequence length, batch, schedule, the number of tokens) is what `gptrun transfer` refuses
to change or, for the token horizon, leaves to an explicit empirical rule.

`coord_check` is the paper's diagnostic: train models of several widths for a few steps at a
high learning rate and watch the mean |activation| of each layer. Under µP it is flat in width;
under SP the logits (and with them everything downstream of the updates) grow with width.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gptcore.config import ModelConfig
from gptcore.data import TokenData
from gptcore.model import GPT
from gptcore.optim import AdamW, param_groups, set_lr


def coord_batches(data: TokenData, count: int, seq_len: int = 32) -> list[tuple[Tensor, Tensor]]:
    """`count` one-window batches of the train split for `coord_check`. Few tokens per batch keep
    the update's coherent part (the one µP scales) above the per-entry noise of Adam's sign-like
    first steps, which at widths of a few hundred is still visible and shrinks with width."""
    return [
        data.train_batch(
            seed=0, step=i, micro=0, rank=0, world_size=1, batch_size=1, grad_accum=1, seq_len=seq_len
        )
        for i in range(count)
    ]


def coord_check(
    widths: list[int],
    batches: list[tuple[Tensor, Tensor]],
    vocab_size: int,
    *,
    mup: bool,
    lr: float,
    steps: int = 4,
    style: str = "gpt2",
    n_layer: int = 2,
    head_dim: int = 16,
    weight_decay: float = 0.0,
) -> dict[str, np.ndarray]:
    """Mean |activation| of the embedding output, each block's output and the logits, for each
    width, after 0..`steps` AdamW steps (constant lr, no clipping) on one fixed batch (inputs,
    targets), averaged over `batches` (each with its own init seed):
    {layer: array (len(widths), steps + 1)}. With `mup` the base width is widths[0]; heads
    scale with width (d_head fixed), as µP is used here."""
    out: dict[str, np.ndarray] = {}
    for w, width in enumerate(widths):
        for seed, (x, y) in enumerate(batches):
            cfg = ModelConfig(
                style=style,
                n_layer=n_layer,
                n_head=width // head_dim,
                d_model=width,
                seq_len=x.size(1),
                vocab_size=vocab_size,
                mup_base_width=widths[0] if mup else 0,
            )
            for layer, values in _train_and_record(cfg, seed, x, y, lr, steps, weight_decay).items():
                curves = out.setdefault(layer, np.zeros((len(widths), steps + 1)))
                curves[w] += np.array(values) / len(batches)
    return out


def _train_and_record(
    cfg: ModelConfig, seed: int, x: Tensor, y: Tensor, lr: float, steps: int, weight_decay: float
) -> dict[str, list[float]]:
    """Mean |activation| per layer before the first step and after each of `steps` steps."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    width_mult = cfg.width_mult if cfg.mup_base_width else None
    optimizer = AdamW(param_groups(model, weight_decay, mup_width_mult=width_mult), lr=lr, betas=(0.9, 0.95))
    set_lr(optimizer, lr)
    seen: dict[str, list[float]] = {}

    def recorder(name: str):
        return lambda _module, _inputs, output: seen.setdefault(name, []).append(output.abs().mean().item())

    layers = {"embedding": model.drop, **{f"block {i}": block for i, block in enumerate(model.blocks)}}
    for step in range(steps + 1):
        hooks = [module.register_forward_hook(recorder(name)) for name, module in layers.items()]
        with torch.no_grad():
            logits, _ = model(x)
        seen.setdefault("logits", []).append(logits.abs().mean().item())
        for hook in hooks:
            hook.remove()
        if step < steps:
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return seen


def width_slopes(widths: list[int], curves: dict[str, np.ndarray], step: int = -1) -> dict[str, float]:
    """Per layer, the slope of log(mean |activation|) against log(width) at `step`: 0 is flat in
    width, 1 grows in proportion to it."""
    log_w = np.log(np.asarray(widths, dtype=float))
    return {name: float(np.polyfit(log_w, np.log(values[:, step]), 1)[0]) for name, values in curves.items()}
