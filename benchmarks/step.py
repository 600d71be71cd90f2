"""Full training-step throughput and MFU: gptcore's AdamW vs torch.optim.AdamW, same run.

A step is what the training loop does: forward + loss, backward, clip_grad_norm(1.0), optimizer
step, zero_grad. Two identical models train on the same random tokens, one with each optimizer,
steps alternating so that machine-load drift hits both alike. CPU runs in fp32, CUDA in bf16
autocast. MFU = tokens/s * GPT.flops_per_token / peak (gptcore.mfu: measured fp32 matmul peak on
CPU, datasheet dense bf16 peak on GPU).

    python benchmarks/step.py [--device cpu|cuda] [--presets quickstart minimind-26m]
                              [--batch-size B] [--seq-len T] [--steps N] [--warmup W]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from gptcore.config import load_config
from gptcore.mfu import device_peak_flops, mfu
from gptcore.model import GPT
from gptcore.optim import AdamW, param_groups

# (batch, seq_len) per preset: small on CPU so both presets finish in about a minute.
SHAPES = {
    "cpu": {"quickstart": (8, 128), "minimind-26m": (4, 256)},
    "cuda": {"quickstart": (64, 128), "minimind-26m": (32, 512)},
}
LABELS = {"torch": "torch.optim.AdamW(foreach=True)", "ours": "gptcore.optim.AdamW"}


def train_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step (the loop's, without grad accumulation)."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if x.is_cuda else contextlib.nullcontext()
    with autocast:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_preset(
    preset: str, device: torch.device, batch: int, seq_len: int, steps: int, warmup: int, peak: float
) -> None:
    cfg = load_config(None, [f'model.preset="{preset}"', f"model.seq_len={seq_len}"]).model
    torch.manual_seed(0)
    models = {"torch": GPT(cfg).to(device), "ours": GPT(cfg).to(device)}
    models["ours"].load_state_dict(models["torch"].state_dict())
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    optimizers = {
        "torch": torch.optim.AdamW(param_groups(models["torch"], 0.1), foreach=True, **kw),
        "ours": AdamW(param_groups(models["ours"], 0.1), **kw),
    }
    gen = torch.Generator(device=device).manual_seed(1)
    x, y = (
        torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen, device=device) for _ in range(2)
    )

    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(warmup + steps):
        for name, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            train_step(model, optimizers[name], x, y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)

    flops = models["ours"].flops_per_token(seq_len)
    print(
        f"{preset}: {cfg.style}, {models['ours'].num_params() / 1e6:.1f}M params, "
        f"B={batch} T={seq_len}, {flops / 1e6:.1f} MFLOP/token, median of {steps} steps"
    )
    print(f"  {'optimizer':<34}{'ms/step':>10}{'tokens/s':>12}{'MFU':>8}")
    rate = {}
    for name in ("torch", "ours"):
        seconds = statistics.median(times[name])
        rate[name] = batch * seq_len / seconds
        util = mfu(rate[name], flops, peak)
        shown = f"{100 * util:.1f}%" if peak > 0 else "n/a"
        print(f"  {LABELS[name]:<34}{seconds * 1e3:>10.1f}{rate[name]:>12.0f}{shown:>8}")
    print(f"  ratio ours/torch (tokens/s)       {rate['ours'] / rate['torch']:>10.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--presets", nargs="+", default=["quickstart", "minimind-26m"])
    parser.add_argument("--batch-size", type=int, default=0, help="0: a per-preset default")
    parser.add_argument("--seq-len", type=int, default=0, help="0: a per-preset default")
    parser.add_argument(
        "--steps", type=int, default=0, help="timed steps per optimizer (0: 5 on CPU, 20 on CUDA)"
    )
    parser.add_argument(
        "--warmup", type=int, default=-1, help="untimed steps per optimizer (-1: 1 on CPU, 5 on CUDA)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # ops autocast leaves in fp32
    on_cpu = device.type == "cpu"
    steps = args.steps or (5 if on_cpu else 20)
    warmup = args.warmup if args.warmup >= 0 else (1 if on_cpu else 5)

    peak, peak_desc = device_peak_flops(device)
    precision = "fp32" if on_cpu else "bf16 autocast"
    print(f"device {device} ({precision}); peak: {peak_desc}")
    for preset in args.presets:
        default_batch, default_len = SHAPES["cpu" if on_cpu else "cuda"].get(preset, (8, 128))
        bench_preset(
            preset, device, args.batch_size or default_batch, args.seq_len or default_len, steps, warmup, peak
        )


if __name__ == "__main__":
    main()
