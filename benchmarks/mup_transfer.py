"""Does the best learning rate stay put as the model widens? SP and µP over widths x learning rates.

For each width, each learning rate of a grid of powers of 2 and each seed, the same model is
trained in each arm: the standard parametrization (SP), µP with the narrowest width as the base
(`model.mup_base_width`), and µP with a larger output multiplier (`model.mup_output_mult`, 4 by
default; --output-mult 1 leaves that arm out). The arms alternate, so machine-load drift hits all
alike, and every run sees the same tokens. Prints, per arm, the final validation loss (mean over
seeds) at every (width, lr), each width's optimum (the vertex of a parabola in log2 lr through the
grid's best point and its two neighbours), the drift of the optimum from the narrowest to the
widest width in octaves, and each width's loss at the proxy's (narrowest width's) best grid lr:
under µP a wider model should be better there. Draws loss against lr, one curve per width, one
panel per arm. The target: µP's optimum moves by at most 1 octave over 4x width, SP's by more,
and under µP the widest model is best at the proxy's lr.

Why the third arm: GPT-2's init gives small logits, and under SP they grow with width, so a wide
SP model also gets a larger output scale; µP keeps the base width's, which is then worth tuning
on the proxy like the lr (gptcore.mup). Weight decay is on (default 0.1) so that µP's choice for
it shows: the hidden matrices get wd x m beside lr / m, keeping lr x wd the base width's.

Each finished run is appended to --results (JSON lines) and a rerun with the same settings skips
it, so an interrupted benchmark continues (run it in pieces, e.g. under `timeout`), and --summarize
prints the table and draws the plot from the runs there without training any (a run not there is
"-" and a gap). On 2 CPU cores the defaults take ~25 min (measured, quiet machine); on a GPU,
run it bigger, e.g. --widths 128,256,512,1024 --n-layer 4 --seq-len 256 --batch-size 32
--steps 2000 --lrs=-12:-5.

    gptrun prepare --corpus shakespeare --out data/shakespeare-2k --vocab-size 2048
    python benchmarks/mup_transfer.py --data data/shakespeare-2k [--widths 64,128,256]
        [--lrs=-11:-5] [--seeds 2] [--steps 250] [--output-mult 4] [--smoke] [--summarize]
        [--out docs/mup_transfer.png]
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


def arms_of(args: argparse.Namespace) -> dict[str, tuple[int, float]]:
    """Arm name -> (mup_base_width, mup_output_mult)."""
    arms = {"SP": (0, 1.0), "µP": (args.base_width, 1.0)}
    if args.output_mult != 1.0:
        arms[f"µP, output x{args.output_mult:g}"] = (args.base_width, args.output_mult)
    return arms


def settings_of(args: argparse.Namespace) -> dict:
    """What makes two runs comparable: a results line is reused only when these all match."""
    keys = ("data", "steps", "batch_size", "seq_len", "n_layer", "head_dim", "weight_decay", "warmup")
    return {k: getattr(args, k) for k in (*keys, "eval_tokens", "precision", "device", "style", "base_width")}


def train_once(args: argparse.Namespace, arm: tuple[int, float], width: int, log2_lr: int, seed: int) -> dict:
    """One run to the budget: its final val loss (NaN if it diverged), wall time, tokens/s."""
    base_width, output_mult = arm
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
                f"model.mup_base_width={base_width}",
                f"model.mup_output_mult={output_mult}",
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
                "train.compile=false",  # the losses, not the speed, are measured: no compile time
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
    """log2 of the best lr: the vertex of the parabola through the best grid point and its two
    neighbours (it lies within half a step of the best point); a note when the best point is at
    the grid's edge or beside a diverged run."""
    finite = [i for i, loss in enumerate(losses) if math.isfinite(loss)]
    if not finite:
        return math.nan, "every run diverged"
    best = min(finite, key=lambda i: losses[i])
    if best - 1 not in finite or best + 1 not in finite:
        return float(log2_lrs[best]), "the grid point: at the grid's edge, widen --lrs"
    x = [log2_lrs[i] for i in (best - 1, best, best + 1)]
    a, b, _ = np.polyfit(x, [losses[i] for i in (best - 1, best, best + 1)], 2)
    return (float(-b / (2 * a)), "") if a > 0 else (float(log2_lrs[best]), "the grid point: a flat minimum")


def load_results(path: Path, settings: dict) -> dict[tuple, dict]:
    done: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["settings"] == settings:
                done[(rec["arm"], rec["width"], rec["log2_lr"], rec["seed"])] = rec
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/shakespeare-2k")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--lrs", default="-11:-5", help="log2 of the learning rates, LOW:HIGH inclusive")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="d_head, fixed: heads grow with width")
    parser.add_argument("--style", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=float, default=0.1)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--output-mult", type=float, default=4.0, help="the third arm's mup_output_mult")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--base-width", type=int, default=0, help="µP's base width (default: the narrowest)")
    parser.add_argument("--results", default="runs/mup_transfer.jsonl")
    parser.add_argument("--out", default="docs/mup_transfer.png")
    parser.add_argument(
        "--summarize", action="store_true", help="train nothing: the table and plot of the runs in --results"
    )
    parser.add_argument("--smoke", action="store_true", help="a minute's check: 2 widths, 3 lrs, 30 steps")
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.lrs, args.seeds, args.steps, args.eval_tokens = "64,128", "-9:-7", 1, 30, 8192
        args.results, args.out = args.results + ".smoke", "runs/mup_transfer-smoke.png"
    widths = [int(w) for w in args.widths.split(",")]
    low, high = (int(x) for x in args.lrs.split(":"))
    log2_lrs = list(range(low, high + 1))
    args.base_width = args.base_width or widths[0]
    args.vocab_size = json.loads((Path(args.data) / "meta.json").read_text())["vocab_size"]
    arms = arms_of(args)
    settings = settings_of(args)
    results_path = Path(args.results)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_results(results_path, settings)
    total = len(arms) * len(widths) * len(log2_lrs) * args.seeds
    print(
        f"load {os.getloadavg()[0]:.2f} | {total} runs ({len(done)} already in {results_path}): "
        f"arms {', '.join(arms)}; widths {widths}, lr 2^{low}..2^{high}, {args.seeds} seeds, "
        f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens, {args.style} depth "
        f"{args.n_layer}, d_head {args.head_dim}, wd {args.weight_decay}, µP base width {args.base_width}",
        flush=True,
    )
    started = time.perf_counter()
    for seed in range(args.seeds):  # a whole seed first: an interrupted run still has full curves
        for log2_lr in log2_lrs:
            for width in widths:
                for name, arm in arms.items():  # alternating: load drift hits every arm alike
                    key = (name, width, log2_lr, seed)
                    if key in done or args.summarize:
                        continue
                    run = train_once(args, arm, width, log2_lr, seed)
                    rec = dict(zip(("arm", "width", "log2_lr", "seed"), key, strict=True))
                    done[key] = {**rec, **run, "settings": settings}
                    with open(results_path, "a") as f:
                        f.write(json.dumps(done[key]) + "\n")
                    print(
                        f"{name} width {width} lr 2^{log2_lr} seed {seed}: val loss {run['val_loss']:.4f} | "
                        f"{run['seconds']:.0f} s, {run['tokens_per_sec']:,.0f} tok/s ({run['precision']}) | "
                        f"{len(done)}/{total}, {time.perf_counter() - started:.0f} s",
                        flush=True,
                    )
    print(f"load {os.getloadavg()[0]:.2f}")
    table, missing = {}, set()
    for name in arms:
        for w in widths:
            for lr in log2_lrs:
                runs = [done[k]["val_loss"] for s in range(args.seeds) if (k := (name, w, lr, s)) in done]
                table[(name, w, lr)] = statistics.fmean(runs) if runs else math.nan
                if len(runs) < args.seeds:
                    missing.add((name, w, lr))
    if missing:
        print(
            f"{len(missing)} points lack a seed's run (--summarize): '-' where none ran, "
            "else the mean of those that did"
        )
    optima = summarize(table, list(arms), widths, log2_lrs, missing)
    draw(table, optima, list(arms), widths, log2_lrs, args)


def summarize(
    table: dict, arms: list[str], widths: list[int], log2_lrs: list[int], missing: set = frozenset()
) -> dict:
    """Print the loss table, optima, drift and wider-is-better per arm, then the target's
    verdict; return {(arm, width): log2 lr*}."""
    optima, drift = {}, {}
    for name in arms:
        print(f"\n{name}: final val loss (mean over seeds)")
        print(f"{'width':>6}" + "".join(f"{'2^' + str(lr):>8}" for lr in log2_lrs) + f"{'best lr':>18}")
        for w in widths:
            losses = [table[(name, w, lr)] for lr in log2_lrs]
            optima[(name, w)], note = optimum(log2_lrs, losses)
            cells = "".join(
                f"{loss:8.3f}" if math.isfinite(loss) else f"{'-' if (name, w, lr) in missing else 'div':>8}"
                for lr, loss in zip(log2_lrs, losses, strict=True)
            )
            best = optima[(name, w)]
            print(f"{w:>6}{cells}   2^{best:+.2f} = {2**best:.2e}" + (f"  ({note})" if note else ""))
        drift[name] = optima[(name, widths[-1])] - optima[(name, widths[0])]
        print(f"drift of the optimum, width {widths[0]} -> {widths[-1]}: {drift[name]:+.2f} octaves")
        proxy_lr = log2_lrs[int(np.nanargmin([table[(name, widths[0], lr)] for lr in log2_lrs]))]
        at_proxy = [table[(name, w, proxy_lr)] for w in widths]
        wider = all(b < a for a, b in zip(at_proxy, at_proxy[1:], strict=False))
        shown = ", ".join(f"{w}: {loss:.3f}" for w, loss in zip(widths, at_proxy, strict=True))
        verdict = "yes" if wider else "no"
        print(f"at the proxy's best grid lr 2^{proxy_lr}: {shown} -> wider is better: {verdict}")
    sp, mup = abs(drift["SP"]), abs(drift["µP"])
    print(
        f"\ntarget: µP drift <= 1 octave ({mup:.2f}: {'met' if mup <= 1 else 'missed'}), "
        f"SP drift larger ({sp:.2f}: {'met' if sp > mup else 'missed'})"
    )
    widest = ", ".join(
        f"{name} {np.nanmin([table[(name, widths[-1], lr)] for lr in log2_lrs]):.3f}" for name in arms
    )
    print(f"best loss of width {widths[-1]} over the grid: {widest}")
    return optima


def draw(
    table: dict,
    optima: dict,
    arms: list[str],
    widths: list[int],
    log2_lrs: list[int],
    args: argparse.Namespace,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(arms), figsize=(4.6 * len(arms), 4), sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes, arms, strict=True):
        for i, w in enumerate(widths):
            color = cmap(i / max(1, len(widths) - 1))
            ax.plot(
                log2_lrs, [table[(name, w, lr)] for lr in log2_lrs], "o-", color=color, label=f"d_model {w}"
            )
            if math.isfinite(optima[(name, w)]):
                ax.axvline(optima[(name, w)], color=color, ls=":", lw=1)
        ax.set_title(name if name == "SP" else f"{name} (base width {args.base_width})", fontsize=10)
        ax.set_xlabel("log2 learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss")
    finite = [v for v in table.values() if math.isfinite(v)]
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5) + 0.05)
    axes[-1].legend()
    fig.suptitle(
        f"{args.style} depth {args.n_layer}, {args.steps} steps x {args.batch_size * args.seq_len} tokens, "
        f"{args.seeds} seeds, mean; dotted: each width's optimum",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
