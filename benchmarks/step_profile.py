"""Where a training step's time goes: torch.profiler over a few steps, each op's own (self) time
sorted into the parts of the model, for `benchmarks/step.py --profile`.

The parts, by op name and input shapes, which holds for eager ops and for the fused kernels of a
compiled step alike (inductor names a kernel after the ops it fused, and reports it to the profiler
when `TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`, which `step.py --profile` sets):

- optimizer: everything in step.py's `optimizer` profiler region (clip_grad_norm, AdamW, zero_grad);
- embeddings: the token and position embeddings and their backward;
- logits + CE: log_softmax / nll_loss and every other op with a vocab-wide input (the tied
  head's matmuls forward and backward, the fp32 copy of the logits, the tied weight's gradient sum;
  in gptrun's `LinearCrossEntropy` each chunk's logsumexp, softmax and gradient matmuls);
- layer norm, attention (SDPA, the qkv and output projections), MLP (its two matmuls, GELU);
- other: the rest (residual adds, dropout, views, autograd and Python between the ops).

A fused kernel that mixes parts (say a residual add with the next layer norm) counts whole in the
first part its name matches, in the order above.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile, record_function

PARTS = ("embeddings", "logits + CE", "layer norm", "attention", "MLP", "optimizer", "other")
MATMULS = ("mm", "addmm", "bmm", "linear", "matmul")


def time_shares(
    step: Callable[[], None], dims: dict[str, int], steps: int = 3
) -> tuple[float, dict[str, float]]:
    """Profile `steps` calls of `step` (after one unprofiled call): ms per step and each part's share
    of the step's wall-clock. `dims` holds the model's vocab, d_ff and qkv widths."""
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            with record_function("whole step"):
                step()
    events = prof.events()
    wall = sum(e.cpu_time_total for e in events if e.name == "whole step")
    spent = dict.fromkeys(PARTS, 0.0)
    for event in events:
        if event.name == "whole step" or event.self_cpu_time_total <= 0:
            continue
        spent[part_of(event, dims)] += event.self_cpu_time_total
    spent["other"] += wall - sum(spent.values())  # Python and the gaps between ops
    return wall / steps / 1e3, {part: us / wall for part, us in spent.items()}


def part_of(event, dims: dict[str, int]) -> str:
    """Which part of the step an op (or fused kernel) belongs to; see the module doc."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "optimizer":
            return "optimizer"
        parent = parent.cpu_parent
    name = event.name.lower()
    shape_dims = {d for shape in (event.input_shapes or []) for d in shape}
    if "embedding" in name:
        return "embeddings"
    if "softmax" in name or "nll_loss" in name or "cross_entropy" in name or dims["vocab"] in shape_dims:
        return "logits + CE"
    if "layer_norm" in name or "rms_norm" in name:
        return "layer norm"
    if "scaled_dot_product" in name or "attention" in name or dims["qkv"] in shape_dims:
        return "attention"
    if "gelu" in name or "silu" in name or dims["d_ff"] in shape_dims:
        return "MLP"
    if name.removeprefix("aten::") in MATMULS:  # d_model x d_model: attention's output projection
        return "attention"
    return "other"
