"""Optimizer step time: gptcore.optim.AdamW vs torch.optim.AdamW(foreach=True), same run, and on
CUDA torch.optim.AdamW(fused=True) too (fused multi-tensor kernels, CUDA only), to show which path
measures fastest there.

Each optimizes an identical copy of the MiniMind 26M model's parameters (decay / no-decay groups)
with the same random gradients; steps alternate between them so that drift in machine load hits
all alike. Prints the median step time of each, fastest first, and its ratio to foreach (target:
ours <= 1.1x).

    python benchmarks/adamw.py [--iters 30] [--warmup 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gptcore.config import load_config
from gptcore.device import device_argument
from gptcore.model import GPT
from gptcore.optim import AdamW, param_groups


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per optimizer")
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu or cuda[:N]")
    args = parser.parse_args()
    device = args.device

    cfg = load_config(None, ['model.preset="minimind-26m"']).model
    torch.manual_seed(0)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    foreach = "torch.optim.AdamW(foreach=True)"
    arms = {  # what each arm builds on its parameter groups
        "gptcore.optim.AdamW": lambda groups: AdamW(groups, **kw),
        foreach: lambda groups: torch.optim.AdamW(groups, foreach=True, **kw),
    }
    if device.type == "cuda":
        arms["torch.optim.AdamW(fused=True)"] = lambda groups: torch.optim.AdamW(groups, fused=True, **kw)
    first = GPT(cfg)
    optimizers = {}
    for label, build in arms.items():
        model = GPT(cfg)
        model.load_state_dict(first.state_dict())
        model.to(device)
        gen = torch.Generator(device=device).manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
        optimizers[label] = build(param_groups(model, 0.1))

    times: dict[str, list[float]] = {label: [] for label in optimizers}
    for i in range(args.warmup + args.iters):
        for label, opt in optimizers.items():
            seconds = timed(opt.step, device)
            if i >= args.warmup:
                times[label].append(seconds)

    threads = torch.get_num_threads()
    print(
        f"AdamW step, {first.num_params() / 1e6:.1f}M parameters ({cfg.preset}), device={device}"
        f"{f', {threads} threads' if device.type == 'cpu' else ''}, median of {args.iters}, fastest first"
    )
    med = {label: statistics.median(ts) * 1e3 for label, ts in times.items()}
    for label in sorted(med, key=med.get):
        print(f"  {label:<34} {med[label]:8.2f} ms/step {med[label] / med[foreach]:7.3f}x foreach")


if __name__ == "__main__":
    main()
