"""Optimizer step time: gptcore.optim.AdamW vs torch.optim.AdamW(foreach=True), same run.

Both optimize identical copies of the MiniMind 26M model's parameters (decay / no-decay groups)
with the same random gradients; steps alternate between the two so that drift in machine load
hits both alike. Prints the median step time of each and the ratio (target: ours <= 1.1x).

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
    models = {"ours": GPT(cfg).to(device), "torch": GPT(cfg).to(device)}
    models["torch"].load_state_dict(models["ours"].state_dict())
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    optimizers = {
        "ours": AdamW(param_groups(models["ours"], 0.1), **kw),
        "torch": torch.optim.AdamW(param_groups(models["torch"], 0.1), foreach=True, **kw),
    }
    for model in models.values():
        gen = torch.Generator(device=device).manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3

    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for i in range(args.warmup + args.iters):
        for name, opt in optimizers.items():
            seconds = timed(opt.step, device)
            if i >= args.warmup:
                times[name].append(seconds)

    n_params = models["ours"].num_params()
    threads = torch.get_num_threads()
    print(
        f"AdamW step, {n_params / 1e6:.1f}M parameters ({cfg.preset}), device={device}"
        f"{f', {threads} threads' if device.type == 'cpu' else ''}, median of {args.iters}"
    )
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    for name, label in (("torch", "torch.optim.AdamW(foreach=True)"), ("ours", "gptcore.optim.AdamW")):
        print(f"  {label:<34} {med[name]:8.2f} ms/step")
    print(f"  ratio ours/torch                   {med['ours'] / med['torch']:8.3f}x")


if __name__ == "__main__":
    main()
