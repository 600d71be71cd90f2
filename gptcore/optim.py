"""The hand-written AdamW, its parameter groups, and the learning-rate schedules.

AdamW is written out (rather than taken from torch.optim) so the update is on one screen; it
reproduces `torch.optim.AdamW` exactly (same op order, same eps placement) and keeps torch's
state_dict layout, so checkpoints load into either optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from gptcore.config import OptimConfig


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), multi-tensor.

    Per parameter p with gradient g at step t (1-based):

        p   <- p * (1 - lr * wd)                       decoupled: decay does not pass through Adam
        m   <- beta1 * m + (1 - beta1) * g
        v   <- beta2 * v + (1 - beta2) * g^2
        p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    Each line is one `torch._foreach_*` call over all parameters of a group (and device/dtype),
    so a step launches a handful of kernels instead of a handful per parameter.
    State per parameter, as in torch: "step" (float32 scalar tensor on the parameter's device),
    "exp_avg" (m), "exp_avg_sq" (v).

    No host syncs: the bias corrections are computed on the device from the step tensors (as
    torch's capturable AdamW does), `lr` may be a device tensor, and `step(apply=flag)` takes a
    0-dim bool device tensor: where it is False the step changes nothing (weights, moments, step
    count), so a caller can skip a non-finite step without reading the flag on the host. The
    arithmetic when the step applies is today's float for float: the same values in the same
    order as the Python-scalar version, which matches `torch.optim.AdamW`.

    Speed: the denominator and the update are computed in two scratch buffers kept between steps
    (not part of the state). torch allocates them afresh every step; on a CPU those large
    allocations fault in new pages each time and cost more than the arithmetic. The price is two
    parameter-sized buffers held between steps. Skipping by a flag costs a pass over the
    gradients, and the device step size one more pass (torch's addcdiv takes a Python number
    only): 10 passes over the parameters where the host-sync version made 9.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not isinstance(lr, Tensor) and not lr >= 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if not eps >= 0:
            raise ValueError(f"invalid eps {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._scratch: dict[Tensor, tuple[Tensor, Tensor]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # pickling / deepcopy keep the state, not the scratch
        self._scratch = {}

    @torch.no_grad()
    def step(self, closure: Any = None, apply: Tensor | None = None) -> Any:
        """One update of every parameter that has a gradient, unless `apply` (a 0-dim bool tensor
        on the parameters' device) is False; returns closure()'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Bucket by (device, dtype): a foreach call needs all its tensors to agree.
            buckets: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:  # loaded from a checkpoint: steps on the CPU
                    state["step"] = state["step"].to(p.device)
                if p not in self._scratch:
                    self._scratch[p] = (torch.empty_like(p), torch.empty_like(p))
                bucket = buckets.setdefault((p.device, p.dtype), [[], [], [], [], [], [], []])
                for lst, t in zip(
                    bucket,
                    (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *self._scratch[p]),
                    strict=True,
                ):
                    lst.append(t)
            for tensors in buckets.values():
                _adamw_foreach(
                    *tensors,
                    apply=apply,
                    lr=group["lr"],
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss


def _adamw_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    denom: list[Tensor],
    update: list[Tensor],
    *,
    apply: Tensor | None,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of tensors sharing a device and dtype (the math in `AdamW`'s doc), or no
    change where `apply` is False. `denom` and `update` are scratch space shaped like `params`.
    Every factor is a device tensor (no host sync), rounded to the parameters' dtype before use as
    the Python-float factors of torch's AdamW are.

    A skipped step multiplies by 1 and adds 0: its gradients (non-finite, or there would be no
    skip) are zeroed first, and the moments' weights, the decay and the step size are 0."""
    dtype, device = params[0].dtype, params[0].device
    exact = scalar_dtype(device)
    on = torch.ones((), dtype=exact, device=device)  # 1 where the step applies, else 0
    if apply is not None:
        on = apply.to(exact)
        for g in grads:
            g.masked_fill_(~apply, 0.0)
    torch._foreach_add_(steps, [on] * len(steps))
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay * on)
    torch._foreach_lerp_(exp_avgs, grads, [((1 - beta1) * on).to(dtype)] * len(grads))
    torch._foreach_mul_(exp_avg_sqs, torch.where(on == 0, 1.0, beta2).to(dtype))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)  # adds 0 when skipped

    # Bias corrections, one per tensor: a parameter that missed some gradients lags in steps.
    t = torch.stack(steps).to(exact)
    step_size = list((-lr / (1 - beta1**t) * on).unbind())
    bias_correction2_sqrt = list((1 - beta2**t).sqrt().unbind())

    for d, v, u, m, s in zip(denom, exp_avg_sqs, update, exp_avgs, step_size, strict=True):
        torch.sqrt(v, out=d)  # one pass each, where a foreach op would need a copy first
        torch.mul(m, s, out=u)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    # p + (step_size * m) / denom: torch's addcdiv with a Python step size computes it in this order
    torch._foreach_addcdiv_(params, update, denom, 1.0)


def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the optimizer's scalars (lr, bias corrections) computed on `device`: float64,
    as Python floats are, so the values match a host computation; float32 on mps, which has no
    float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = True, mup_width_mult: float | None = None
) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed and a non-decayed group for AdamW.

    Weight decay pulls weights toward 0, which is right for the matrices of linears but wrong for
    norm gains (their neutral value is 1) and biases (no scale to control). Embedding tables are
    matrices too, but many recipes exclude them; `decay_embeddings` chooses. A parameter shared
    by two modules (the tied embedding / lm_head) is an embedding and appears once.

    Under µP (`mup_width_mult` = m, see gptcore.mup) the hidden matrices (weights of the linears
    that are not the tied head) go in a third group, "hidden", with lr x 1/m and weight decay x m,
    so that their per-step decay lr x wd is the base width's. Each group's `lr_mult` is what the
    trainer multiplies the scheduled lr by (1 where absent).
    Groups: {"name": "decay" | "no_decay" | "hidden", "params": [...], "weight_decay": ...}; an
    empty group is left out.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden_ids = set()
    if mup_width_mult is not None:
        hidden_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embedding_ids
    decay: list[Tensor] = []
    no_decay: list[Tensor] = []
    hidden: list[Tensor] = []
    for p in model.parameters():  # yields each shared parameter once
        if not p.requires_grad:
            continue
        if id(p) in embedding_ids:
            (decay if decay_embeddings else no_decay).append(p)
        elif id(p) in hidden_ids:
            hidden.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        dict(name="decay", params=decay, weight_decay=weight_decay),
        dict(name="no_decay", params=no_decay, weight_decay=0.0),
    ]
    if mup_width_mult is not None:
        m = mup_width_mult
        groups.insert(0, dict(name="hidden", params=hidden, weight_decay=weight_decay * m, lr_mult=1.0 / m))
    return [g for g in groups if g["params"]]


def set_lr(optimizer: torch.optim.Optimizer, lr: float | Tensor) -> None:
    """Set the scheduled `lr` (a number, or a 0-dim device tensor for `AdamW`) on every group,
    times the group's `lr_mult` (µP's hidden matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def warmup_steps(total_steps: int, warmup: float) -> int:
    """Warmup length in steps: `warmup` >= 1 is a step count, < 1 a fraction of the run."""
    if warmup >= 1:
        return int(math.floor(warmup + 0.5))
    return int(math.floor(warmup * total_steps + 0.5))  # half rounds up, not to even


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of a `total_steps` run.

    Warmup: lr * (step + 1) / W for the first W steps, so step 0 is small but not 0 (a zero-lr
    step would be wasted) and step W - 1 is exactly cfg.lr. After the peak:
    - "constant": cfg.lr;
    - "cosine": half a cosine from cfg.lr at the peak to cfg.lr * min_lr_ratio at the last step;
    - "wsd" (warmup-stable-decay): cfg.lr until the last `decay_fraction` of the run, then a
      straight line to the floor at the last step. A run can be extended or branched from any
      stable-phase checkpoint, which is why WSD suits sweeps.
    Steps past the end stay at the floor.
    """
    warmup = warmup_steps(total_steps, cfg.warmup)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    peak = max(warmup - 1, 0)
    last = total_steps - 1
    start = peak
    if cfg.schedule == "wsd":
        decay = max(1, int(math.floor(cfg.decay_fraction * total_steps + 0.5)))
        start = max(peak, last - decay)
    progress = min(1.0, max(0.0, (step - start) / max(1, last - start)))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - floor) * progress
