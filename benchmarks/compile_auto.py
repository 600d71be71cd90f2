"""Does `train.compile = auto` pick right? A whole `gptrun train --local` run, compile auto vs off
vs on: wall-clock including the compile, the final val loss, and auto's decision.

Each arm is the real command in its own process (start-up, data, compile, evaluation and all):

    gptrun train --local CONFIG --set train.max_steps=N --set train.compile=ARM

with the config's seed, so the arms train on the same batches from the same init. Rounds
alternate the arms' order (auto, false, true; then true, false, auto; ...) so that machine-load
drift hits all alike. Inductor's on-disk cache starts empty in a temporary folder shared by the
rounds: the first compiling arm compiles cold, later ones from a warm cache, as the later trials of
a sweep on one node do. The compile costs that auto reads stay in gptrun's cache folder, as for
any run on this machine.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/compile_auto.py [--config experiments/configs/quickstart.toml]
                                      [--steps 150] [--arms auto,false,true] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile

from arguments import comma_list
from timed_cli import timed_gptrun

ARMS = ("auto", "false", "true")
VAL_LOSS = re.compile(r"eval step (\d+) \| val loss ([0-9.]+)")


def train_once(config: str, steps: int, arm: str, out: str, env: dict[str, str]) -> dict:
    """One `gptrun train --local` run: wall-clock seconds, the last val loss, the compile line."""
    args = ["train", "--local", config, "--set", f"train.max_steps={steps}"]
    args += ["--set", f"train.compile={arm}", "--set", f'train.out="{out}"']
    seconds, log = timed_gptrun(args, env, f"arm {arm}")
    losses = VAL_LOSS.findall(log)
    compile_line = next((line for line in log.splitlines() if "compile " in line), "(no compile line)")
    return {"seconds": seconds, "val_loss": float(losses[-1][1]), "compile": compile_line.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/configs/quickstart.toml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--arms", type=comma_list(ARMS), default=list(ARMS), help="comma list of auto, false, true"
    )
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    arms = args.arms

    runs: dict[str, list[dict]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="compile-auto-") as scratch:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor")}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                run = train_once(args.config, args.steps, arm, os.path.join(scratch, f"{arm}-{r}"), env)
                runs[arm].append(run)
                print(
                    f"round {r} compile={arm}: {run['seconds']:.1f} s, val loss {run['val_loss']:.4f}"
                    f"\n    {run['compile']}",
                    flush=True,
                )

    print(f"\n{'train.compile':<15}{'wall s (median)':>17}{'val loss':>10}{'vs false':>10}")
    base = statistics.median(r["seconds"] for r in runs["false"]) if "false" in runs else None
    for arm, done in runs.items():
        seconds = statistics.median(r["seconds"] for r in done)
        ratio = f"{base / seconds:.3f}x" if base else ""
        print(f"{arm:<15}{seconds:>17.1f}{done[-1]['val_loss']:>10.4f}{ratio:>10}")
    print("(vs false: compile=false's wall-clock / the arm's; above 1 is faster)")


if __name__ == "__main__":
    main()
