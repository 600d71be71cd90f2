"""Full training-step throughput and MFU: fp32 vs bf16 autocast, gptcore's AdamW vs torch's, and
eager vs torch.compile'd model.

A step is what the training loop does: forward + loss (in `gptcore.train.autocast` of the
precision), backward, clip_grad_norm(1.0), optimizer step, zero_grad. Per preset, one model per
(precision, optimizer), all from the same init, train on the same random tokens, steps alternating
so that machine-load drift hits all alike. MFU = tokens/s * GPT.flops_per_token / the peak of the
variant's own precision (gptcore.mfu: measured fp32 or bf16 matmul peak on CPU, the datasheet
dense bf16 peak on GPU, for fp32 too). A compiled variant compiles the model as the trainer does
(`torch.compile(model)`), first with an empty inductor cache (cold), then again after
`torch._dynamo.reset()` from the on-disk cache the first compile filled (warm, as a later trial
on the node); its compile seconds are the first step's time less a compiled step's. `--profile`
then profiles a few steps of each variant and prints where their time goes (see
benchmarks/step_profile.py). `--baseline nanogpt` adds nanoGPT's own model.py (vendored in
benchmarks/vendor, bias=True, dropout 0) with the AdamW its `configure_optimizers` makes, at the
preset's shape, in two arms: fp32 eager as nanoGPT trains on a CPU, and nanoGPT at its best,
`torch.compile`d in the precision `train.precision = "auto"` picks on the device (bf16 autocast,
nanoGPT's `dtype = 'bfloat16'`, where bf16 matmuls are fast; fp32 on a CPU that emulates bf16); it
prints each variant's speed over both.

    python benchmarks/step.py [--device cpu|cuda] [--presets quickstart minimind-26m]
                              [--precision fp32,bf16,auto] [--optimizers torch,ours]
                              [--modes eager,compiled] [--baseline nanogpt]
                              [--set model.KEY=VALUE ...]
                              [--batch-size B] [--seq-len T] [--steps N] [--warmup W]
                              [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import statistics
import tempfile
import time

import torch
from arguments import comma_list
from step_profile import PARTS, time_shares
from torch.profiler import record_function
from vendor import nanogpt_model

from gptcore.config import load_config
from gptcore.device import device_argument
from gptcore.errors import UserError
from gptcore.mfu import device_peak_flops, mfu
from gptcore.model import GPT
from gptcore.optim import AdamW, param_groups
from gptcore.train import autocast, resolve_precision

# (batch, seq_len) per preset: small on CPU so both presets finish in about a minute.
SHAPES = {
    "cpu": {"quickstart": (8, 128), "minimind-26m": (4, 256)},
    "cuda": {"quickstart": (64, 128), "minimind-26m": (32, 512)},
}
LABELS = {"torch": "torch AdamW(foreach)", "ours": "gptcore AdamW", "nanogpt": "nanoGPT + its AdamW"}
SHORT = {"torch": "torch AdamW", "ours": "gptcore AdamW"}
NANOGPT_CPU = ("fp32", "nanogpt", "eager")  # --baseline: nanoGPT as it trains on a CPU


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, precision: str
) -> None:
    """One training step (the loop's, without grad accumulation); the optimizer's part is marked
    for `--profile`."""
    with autocast(x.device, precision):
        _, loss = model(x, y)
    loss.backward()
    with record_function("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def compile_seconds(
    model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, precision: str
) -> tuple[torch.nn.Module, float, float]:
    """torch.compile `model`: (the compiled module, cold and warm compile seconds). Each compile
    is the first compiled step's time less the median of three compiled steps."""
    timings = []
    for _ in ("cold", "warm"):
        torch._dynamo.reset()
        compiled = torch.compile(model)
        first = timed_step(compiled, opt, x, y, precision)
        steady = statistics.median(timed_step(compiled, opt, x, y, precision) for _ in range(3))
        timings.append(first - steady)
    return compiled, timings[0], timings[1]


def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x, y, precision: str) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    train_step(model, opt, x, y, precision)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


def nanogpt_baseline(cfg, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """nanoGPT's GPT at `cfg`'s shape and the optimizer its train.py would make on `device`."""
    shape = nanogpt_model.GPTConfig(
        block_size=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.d_model,
        dropout=0.0,
        bias=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter counts
        model = nanogpt_model.GPT(shape).to(device)
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device.type)
    return model, opt


def make_optimizer(name: str, model: GPT) -> torch.optim.Optimizer:
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    if name == "torch":
        return torch.optim.AdamW(param_groups(model, 0.1), foreach=True, **kw)
    return AdamW(param_groups(model, 0.1), **kw)


def bench_preset(
    preset: str,
    device: torch.device,
    batch: int,
    seq_len: int,
    steps: int,
    warmup: int,
    variants: list[tuple[str, str, str]],
    peaks: dict[str, float],
    profile: bool,
    sets: list[str],
    baselines: list[tuple[str, str, str]],
) -> None:
    cfg = load_config(None, [f'model.preset="{preset}"', f"model.seq_len={seq_len}", *sets]).model
    torch.manual_seed(0)
    first = GPT(cfg).to(device)
    models = {v: GPT(cfg).to(device) for v in variants}
    for model in models.values():
        model.load_state_dict(first.state_dict())
    optimizers = {v: make_optimizer(v[1], model) for v, model in models.items()}
    for v in baselines:
        models[v], optimizers[v] = nanogpt_baseline(cfg, device)
    variants = [*baselines, *variants]
    gen = torch.Generator(device=device).manual_seed(1)
    x, y = (
        torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen, device=device) for _ in range(2)
    )
    compiles: dict[tuple[str, str, str], tuple[float, float]] = {}
    for v in variants:
        if v[2] == "compiled":
            models[v], *compiles[v] = compile_seconds(models[v], optimizers[v], x, y, v[0])

    times: dict[tuple[str, str, str], list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        for v, model in models.items():
            seconds = timed_step(model, optimizers[v], x, y, v[0])
            if i >= warmup:
                times[v].append(seconds)

    flops = first.flops_per_token(seq_len)
    print(
        f"{preset}: {cfg.style}, {cfg.n_layer} layers, d_model {cfg.d_model}, "
        f"{first.num_params() / 1e6:.1f}M params, B={batch} T={seq_len}, "
        f"{flops / 1e6:.1f} MFLOP/token, median of {steps} steps"
    )
    print(
        f"  {'precision':<10}{'optimizer':<22}{'model':<10}{'ms/step':>9}{'tokens/s':>10}{'MFU':>7}"
        f"{'compile s cold / warm':>23}"
    )
    rate = {}
    for v in variants:
        seconds = statistics.median(times[v])
        rate[v] = batch * seq_len / seconds
        util = mfu(rate[v], flops, peaks[v[0]])
        shown = f"{100 * util:.1f}%" if 0 < util <= 1 else "n/a"  # over 100%: the peak is wrong
        compiled = f"{compiles[v][0]:.1f} / {compiles[v][1]:.1f}" if v in compiles else ""
        row = f"  {v[0]:<10}{LABELS[v[1]]:<22}{v[2]:<10}{seconds * 1e3:>9.1f}{rate[v]:>10.0f}"
        print(f"{row}{shown:>7}{compiled:>23}")
    variants = variants[len(baselines) :]
    for base, v in itertools.product(baselines, variants):
        ratio = rate[v] / rate[base]
        over = f"nanoGPT {base[0]} {base[2]}"
        print(f"  ratio over {over:<22}(tokens/s), {v[0]}, {SHORT[v[1]]}, {v[2]:<9}{ratio:>10.3f}x")
    precisions, names, modes = ({v[i] for v in variants} for i in range(3))
    for mode in sorted(modes, reverse=True):  # eager first
        if precisions == {"fp32", "bf16"}:
            for name in sorted(names):
                ratio = rate[("bf16", name, mode)] / rate[("fp32", name, mode)]
                print(f"  ratio bf16/fp32 (tokens/s), {SHORT[name]}, {mode:<12}{ratio:>10.3f}x")
        if names == {"torch", "ours"}:
            for p in sorted(precisions, reverse=True):  # fp32 first
                ratio = rate[(p, "ours", mode)] / rate[(p, "torch", mode)]
                print(f"  ratio ours/torch (tokens/s), {p}, {mode:<17}{ratio:>10.3f}x")
    if modes == {"eager", "compiled"}:
        for p, name in itertools.product(sorted(precisions, reverse=True), sorted(names)):
            ratio = rate[(p, name, "compiled")] / rate[(p, name, "eager")]
            print(f"  ratio compiled/eager (tokens/s), {p}, {SHORT[name]:<14}{ratio:>10.3f}x")
    if profile:
        print_profile(cfg, models, optimizers, x, y)


def print_profile(cfg, models: dict, optimizers: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    """Each variant's step time split into the parts of step_profile.PARTS (torch.profiler, 3 steps)."""
    dims = {
        "vocab": cfg.vocab_size,
        "d_ff": cfg.d_ff,
        "qkv": (cfg.n_head + 2 * cfg.n_kv_head) * (cfg.d_model // cfg.n_head),
    }
    print(f"  time shares (torch.profiler, self time of each op, 3 steps): {', '.join(PARTS)}")
    print(
        f"  {'precision':<10}{'optimizer':<22}{'model':<10}{'ms/step':>9}"
        + "".join(f"{p:>13}" for p in PARTS)
    )
    for v, model in models.items():

        def step(model=model, opt=optimizers[v], precision=v[0]):
            train_step(model, opt, x, y, precision)

        ms, shares = time_shares(step, dims)
        row = f"  {v[0]:<10}{LABELS[v[1]]:<22}{v[2]:<10}{ms:>9.1f}"
        print(row + "".join(f"{100 * shares[p]:>12.1f}%" for p in PARTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--presets", nargs="+", default=["quickstart", "minimind-26m"])
    parser.add_argument(
        "--precision",
        type=comma_list(("fp32", "bf16", "auto")),
        default=["fp32", "bf16"],
        help="auto: what train.precision = auto picks on the device",
    )
    parser.add_argument("--optimizers", type=comma_list(("torch", "ours")), default=["torch", "ours"])
    parser.add_argument("--modes", type=comma_list(("eager", "compiled")), default=["eager"])
    parser.add_argument("--batch-size", type=int, default=0, help="0: a per-preset default")
    parser.add_argument("--seq-len", type=int, default=0, help="0: a per-preset default")
    parser.add_argument(
        "--steps", type=int, default=0, help="timed steps per variant (0: 5 on CPU, 20 on CUDA)"
    )
    parser.add_argument(
        "--warmup", type=int, default=-1, help="untimed steps per variant (-1: 1 on CPU, 5 on CUDA)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also print where each variant's step time goes"
    )
    parser.add_argument(
        "--baseline",
        choices=["nanogpt"],
        help="also time nanoGPT's model.py + AdamW: fp32 eager, and compiled in auto's precision",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="model.KEY=VALUE", help="a model key over the preset"
    )
    args = parser.parse_args()
    try:  # a key or value the config refuses: one line, exit 2
        load_config(None, args.set)
    except UserError as err:
        parser.error(f"--set: {err}")
    device = args.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # ops autocast leaves in fp32
    on_cpu = device.type == "cpu"
    steps = args.steps or (5 if on_cpu else 20)
    warmup = args.warmup if args.warmup >= 0 else (1 if on_cpu else 5)

    peaks = {}
    precisions = list(dict.fromkeys(resolve_precision(p, device)[0] for p in args.precision))
    baselines = []  # nanoGPT as it trains on a CPU, and at its best
    if args.baseline:
        baselines = [NANOGPT_CPU, (resolve_precision("auto", device)[0], "nanogpt", "compiled")]
    for precision in dict.fromkeys([*precisions, *(v[0] for v in baselines)]):
        peaks[precision], desc = device_peak_flops(device, precision)
        print(f"device {device}, {precision} peak: {desc}")
    variants = list(itertools.product(precisions, args.optimizers, args.modes))
    if "compiled" in args.modes or args.baseline:  # an empty inductor cache: a cold first compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="step-bench-inductor-")
    if args.profile:  # compiled kernels report to the profiler under their fused ops' names
        torch._inductor.config.cpp.enable_kernel_profile = True
    for preset in args.presets:
        default_batch, default_len = SHAPES["cpu" if on_cpu else "cuda"].get(preset, (8, 128))
        batch, seq_len = args.batch_size or default_batch, args.seq_len or default_len
        bench_preset(
            preset,
            device,
            batch,
            seq_len,
            steps,
            warmup,
            variants,
            peaks,
            args.profile,
            args.set,
            baselines,
        )


if __name__ == "__main__":
    main()
