"""The µP coordinate check, drawn: mean |activation| per layer against width, SP beside µP.

Trains models of each width (depth 2, d_head 16, heads growing with width) for a few AdamW steps
at a high learning rate on fixed batches of a prepared corpus (`gptcore.mup.coord_check`, the
check tests/test_mup.py runs at widths 64-256) and plots, for the embedding output, each block's
output and the logits, the mean |activation| against width, one line per step, one row per
parametrization. Under µP the lines are flat; under the standard parametrization the updates
make them grow with width. Prints the log-log slope of each layer at the last step.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/mup_coord_check.py [--data data/shakespeare] [--widths 64,128,256,512,1024]
        [--style gpt2|llama] [--lr 1e-2] [--steps 5] [--batches 16] [--out docs/mup_coord_check.png]
"""

from __future__ import annotations

import argparse
import os
import time

from gptcore.data import TokenData
from gptcore.mup import coord_batches, coord_check, width_slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--widths", default="64,128,256,512,1024")
    parser.add_argument("--style", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batches", type=int, default=16, help="batches (and init seeds) averaged over")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--out", default="docs/mup_coord_check.png")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    data = TokenData(args.data)
    batches = coord_batches(data, args.batches, args.seq_len)
    print(
        f"load {os.getloadavg()[0]:.2f} | {args.style}, widths {widths}, lr {args.lr:g}, {args.steps} steps"
    )
    curves = {}
    for name, mup in (("SP", False), ("µP", True)):
        start = time.perf_counter()
        curves[name] = coord_check(
            widths, batches, data.vocab_size, mup=mup, lr=args.lr, steps=args.steps, style=args.style
        )
        slopes = width_slopes(widths, curves[name])
        shown = ", ".join(f"{layer} {slope:+.2f}" for layer, slope in slopes.items())
        print(f"{name}: log-log slope at step {args.steps}: {shown} ({time.perf_counter() - start:.0f} s)")
    print(f"load {os.getloadavg()[0]:.2f}")
    draw(curves, widths, args)


def draw(curves: dict, widths: list[int], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(curves["SP"])
    fig, axes = plt.subplots(2, len(layers), figsize=(3.2 * len(layers), 5.6), sharex=True)
    cmap = plt.get_cmap("viridis")
    for row, (name, layer_curves) in enumerate(curves.items()):
        for col, layer in enumerate(layers):
            ax = axes[row][col]
            for t in range(args.steps + 1):
                ax.plot(
                    widths, layer_curves[layer][:, t], "o-", ms=3, color=cmap(t / args.steps), label=f"t={t}"
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {layer}", fontsize=10)
            if row == 1:
                ax.set_xlabel("width (d_model)")
            if col == 0:
                ax.set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7, title="step")
    fig.suptitle(f"coordinate check ({args.style}, depth 2, AdamW lr {args.lr:g}, {args.data})", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
