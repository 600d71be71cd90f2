"""Does the best learning rate stay put as the model widens? SP and µP over widths x learning rates.

For each width, each learning rate of a grid of powers of 2, each seed, the same model is trained
twice, in the standard parametrization (SP) and in µP with the narrowest width as the base
(`model.mup_base_width`), the two alternating so that machine-load drift hits both alike; every
run sees the same tokens. Prints, per parametrization, the final validation loss (mean over
seeds) at every (width, lr), each width's optimum (the vertex of a parabola in log2 lr through the
grid's best point and its neighbours), the drift of the optimum from the narrowest to the widest
width in octaves, and the loss of each width at the proxy's (narrowest width's) best grid lr:
under µP a wider model should be better there. Draws loss against lr, one curve per width, one
panel per parametrization. The target: µP's optimum moves by at most 1 octave over 4x width, SP's
by more, and under µP the widest model is best at the proxy's lr.

Weight decay is on (default 0.1) so that µP's choice for it shows: the hidden matrices get
wd x m beside lr / m, keeping lr x wd, the per-step decay, the base width's (gptcore.mup).

Each finished run is appended to --results (JSON lines) and a rerun with the same settings skips
it, so an interrupted benchmark continues. On 2 CPU cores the defaults take ~45 min; on a GPU,
run it bigger, e.g. --widths 128,256,512,1024 --n-layer 4 --seq-len 256 --batch-size 32
--steps 1000 --lrs=-12:-5.

    gptrun prepare --corpus shakespeare --out data/shakespeare-2k --vocab-size 2048
    python benchmarks/mup_transfer.py --data data/shakespeare-2k [--widths 64,128,256]
        [--lrs=-11:-5] [--seeds 2] [--steps 200] [--smoke] [--out docs/mup_transfer.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gptcore.config import load_config
from gptcore.errors import DivergedError
from gptcore.train import Trainer

PARAMETRIZATIONS = ("SP", "µP")


def settings_of(args: argparse.Namespace) -> dict:
    """What makes two runs comparable: a results line is reused only when these all match."""
    keys = ("data", "steps", "batch_size", "seq_len", "n_layer", "head_dim", "weight_decay", "warmup")
    return {k: getattr(args, k) for k in (*keys, "precision", "device", "style", "base_width")}


def train_once(args: argparse.Namespace, parametrization: str, width: int, log2_lr: int, seed: int) -> dict:
    """One run to the budget: its final val loss (NaN if it diverged), wall time, tokens/s."""
    mup = parametrization == "µP"
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            None,
            [
                f'model.style="{args.style}"',
                f"model.n_layer={args.n_layer}",
                f"model.d_model={width}",
                f"model.n_head={width // args.head_dim}",
                f"model.seq_len={args.seq_len}",
                f"model.vocab_size={args.vocab_size}",
                f"model.mup_base_width={args.base_width if mup else 0}",
                f'data.dir="{args.data}"',
                f"optim.lr={2.0**log2_lr}",
                f"optim.weight_decay={args.weight_decay}",
                f"optim.warmup={args.warmup}",
                f"train.batch_size={args.batch_size}",
                f"train.max_steps={args.steps}",
                f"train.eval_interval={args.steps}",
                f"train.eval_tokens={args.eval_tokens}",
                f"train.seed={seed}",
                f'train.precision="{args.precision}"',
                f'train.device="{args.device}"',
                f'train.out="{out}"',
            ],
        )
        start = time.perf_counter()
        trainer = Trainer(cfg, log=None)
        try:
            val_loss = trainer.fit()["val_loss"]
        except DivergedError:
            val_loss = math.nan
    seconds = time.perf_counter() - start
    tokens = args.steps * args.batch_size * args.seq_len
    return {
        "val_loss": val_loss if math.isfinite(val_loss) else math.nan,
        "seconds": seconds,
        "tokens_per_sec": tokens / seconds,
        "precision": trainer.precision,
    }


def optimum(log2_lrs: list[int], losses: list[float]) -> tuple[float, str]:
    """log2 of the best lr: the vertex of a parabola through the best grid point and its two
    neighbours on each side (as many as the grid has); a note when it is not an interior one."""
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss)]
    if not finite:
        return math.nan, "every run diverged"
    best = min(finite, key=lambda i: losses[i])
    near = [i for i in range(best - 2, best + 3) if i in finite]
    if best in (finite[0], finite[-1]) or len(near) < 3:
        return float(log2_lrs[best]), "at the grid's edge: widen --lrs"
    a, b, _ = np.polyfit([log2_lrs[i] for i in near], [losses[i] for i in near], 2)
    if a <= 0:
        return float(log2_lrs[best]), "no curvature: the grid point"
    vertex = -b / (2 * a)
    return float(min(max(vertex, log2_lrs[near[0]]), log2_lrs[near[-1]])), ""


def load_results(path: Path, settings: dict) -> dict[tuple, dict]:
    done: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["settings"] == settings:
                done[(rec["parametrization"], rec["width"], rec["log2_lr"], rec["seed"])] = rec
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/shakespeare-2k")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--lrs", default="-11:-5", help="log2 of the learning rates, LOW:HIGH inclusive")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="d_head, fixed: heads grow with width")
    parser.add_argument("--style", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=float, default=0.1)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--base-width", type=int, default=0, help="µP's base width (default: the narrowest)")
    parser.add_argument("--results", default="runs/mup_transfer.jsonl")
    parser.add_argument("--out", default="docs/mup_transfer.png")
    parser.add_argument("--smoke", action="store_true", help="a minute's check: 2 widths, 3 lrs, 30 steps")
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.lrs, args.seeds, args.steps = "64,128", "-9:-7", 1, 30
        args.eval_tokens, args.results, args.out = (
            8192,
            args.results + ".smoke",
            args.out.replace(".png", "-smoke.png"),
        )
    widths = [int(w) for w in args.widths.split(",")]
    low, high = (int(x) for x in args.lrs.split(":"))
    log2_lrs = list(range(low, high + 1))
    args.base_width = args.base_width or widths[0]
    args.vocab_size = json.loads((Path(args.data) / "meta.json").read_text())["vocab_size"]
    settings = settings_of(args)
    results_path = Path(args.results)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_results(results_path, settings)
    total = len(PARAMETRIZATIONS) * len(widths) * len(log2_lrs) * args.seeds
    print(
        f"load {os.getloadavg()[0]:.2f} | {total} runs ({len(done)} already in {results_path}): "
        f"widths {widths}, lr 2^{low}..2^{high}, {args.seeds} seeds, {args.steps} steps x "
        f"{args.batch_size} x {args.seq_len} tokens, {args.style} depth {args.n_layer}, "
        f"d_head {args.head_dim}, wd {args.weight_decay}, µP base width {args.base_width}",
        flush=True,
    )
    started = time.perf_counter()
    for seed in range(args.seeds):  # a whole seed first: an interrupted run still has full curves
        for log2_lr in log2_lrs:
            for width in widths:
                for parametrization in PARAMETRIZATIONS:  # alternating: load drift hits both
                    key = (parametrization, width, log2_lr, seed)
                    if key in done:
                        continue
                    run = train_once(args, parametrization, width, log2_lr, seed)
                    rec = dict(zip(("parametrization", "width", "log2_lr", "seed"), key, strict=True))
                    done[key] = {**rec, **run, "settings": settings}
                    with open(results_path, "a") as f:
                        f.write(json.dumps(done[key]) + "\n")
                    print(
                        f"{parametrization} width {width} lr 2^{log2_lr} seed {seed}: val loss "
                        f"{run['val_loss']:.4f} | {run['seconds']:.0f} s, {run['tokens_per_sec']:,.0f} tok/s "
                        f"({run['precision']}) | {len(done)}/{total}, {time.perf_counter() - started:.0f} s",
                        flush=True,
                    )
    print(f"load {os.getloadavg()[0]:.2f}")
    table = {
        (p, w, lr): statistics.fmean(done[(p, w, lr, s)]["val_loss"] for s in range(args.seeds))
        for p in PARAMETRIZATIONS
        for w in widths
        for lr in log2_lrs
    }
    optima = summarize(table, widths, log2_lrs)
    draw(table, optima, widths, log2_lrs, args)


def summarize(table: dict, widths: list[int], log2_lrs: list[int]) -> dict:
    """Print the loss table, optima, drift and wider-is-better; return {(p, width): log2 lr*}."""
    optima = {}
    for p in PARAMETRIZATIONS:
        print(f"\n{p}: final val loss (mean over seeds)")
        print(f"{'width':>6}" + "".join(f"{'2^' + str(lr):>8}" for lr in log2_lrs) + f"{'best lr':>18}")
        for w in widths:
            losses = [table[(p, w, lr)] for lr in log2_lrs]
            best, note = optimum(log2_lrs, losses)
            optima[(p, w)] = best
            cells = "".join(f"{loss:8.3f}" if math.isfinite(loss) else f"{'div':>8}" for loss in losses)
            print(f"{w:>6}{cells}   2^{best:+.2f} = {2**best:.2e}" + (f"  ({note})" if note else ""))
        drift = optima[(p, widths[-1])] - optima[(p, widths[0])]
        print(f"drift of the optimum, width {widths[0]} -> {widths[-1]}: {drift:+.2f} octaves")
        proxy_lr = log2_lrs[int(np.nanargmin([table[(p, widths[0], lr)] for lr in log2_lrs]))]
        at_proxy = [table[(p, w, proxy_lr)] for w in widths]
        wider = all(b < a for a, b in zip(at_proxy, at_proxy[1:], strict=False))
        shown = ", ".join(f"{w}: {loss:.3f}" for w, loss in zip(widths, at_proxy, strict=True))
        verdict = "yes" if wider else "no"
        print(f"at the proxy's best grid lr 2^{proxy_lr}: {shown} -> wider is better: {verdict}")
    sp = abs(optima[("SP", widths[-1])] - optima[("SP", widths[0])])
    mup = abs(optima[("µP", widths[-1])] - optima[("µP", widths[0])])
    print(
        f"\ntarget: µP drift <= 1 octave ({mup:.2f}: {'met' if mup <= 1 else 'missed'}), "
        f"SP drift larger ({sp:.2f}: {'met' if sp > mup else 'missed'})"
    )
    return optima


def draw(table: dict, optima: dict, widths: list[int], log2_lrs: list[int], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, p in zip(axes, PARAMETRIZATIONS, strict=True):
        for i, w in enumerate(widths):
            color = cmap(i / max(1, len(widths) - 1))
            ax.plot(log2_lrs, [table[(p, w, lr)] for lr in log2_lrs], "o-", color=color, label=f"d_model {w}")
            if math.isfinite(optima[(p, w)]):
                ax.axvline(optima[(p, w)], color=color, ls=":", lw=1)
        ax.set_title(p if p == "SP" else f"µP (base width {args.base_width})")
        ax.set_xlabel("log2 learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss")
    finite = [v for v in table.values() if math.isfinite(v)]
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 2.0))
    axes[1].legend()
    fig.suptitle(
        f"{args.style} depth {args.n_layer}, {args.steps} steps x {args.batch_size * args.seq_len} tokens, "
        f"{args.seeds} seeds; dotted: each width's optimum",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
