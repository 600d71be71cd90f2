"""What a sweep's trials pay to compile: the demo sweep with `train.compile` false vs true (and
auto), each trial's compile seconds (the first cold, later ones from the shared warm cache) and
start-up, and each sweep's wall-clock.

Each arm is the real command in its own process, on a local Ray instance:

    gptrun sweep CONFIG --name compile-ARM --storage TMP --restart --set train.compile=ARM

Inductor's on-disk cache starts empty in a temporary folder that the arms share (what
`gptcore.autocompile.share_compile_cache` gives every trial on a node), so the first compiling
trial compiles cold and the later ones warm. gptrun's cache folder (the compile costs auto reads)
starts empty too, so auto starts from the prior and learns from the arms before it. Lean trials
run in reused processes (`reuse_actors`), so a later trial in a process also finds dynamo's and
inductor's in-memory caches from the trial before it. Arms run in the order given (`true` before `auto`
leaves auto a measured compile cost to decide on). Ray's log deduplication is off so that every
trial's compile line reaches this script.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/compile_sweep.py [--config experiments/configs/quickstart.toml]
                                       [--arms false,true,auto] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
from pathlib import Path

from arguments import comma_list
from timed_cli import timed_gptrun

from experiments.results import load_trials

COMPILED = re.compile(r"\((?:\w+ )?pid=(\d+)[^)]*\).*compiled in ([0-9.]+) (s|min)")
DECIDED = re.compile(
    r"\((?:\w+ )?pid=(\d+)[^)]*\).*(compile (?:on|off) \((?:auto|train\.compile=\w+)\)[^|\n]*)"
)
COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the trials' prefixes even into a pipe


def sweep_once(config: str, arm: str, storage: Path, sets: list[str], env: dict[str, str]) -> dict:
    """One sweep: its wall-clock, each compile's seconds in the order the trials logged them, the
    decisions, and the trials' start-up."""
    name = f"compile-{arm}"
    args = ["sweep", config, "--name", name, "--storage", str(storage), "--restart"]
    for item in [f"train.compile={arm}", *sets]:
        args += ["--set", item]
    seconds, log = timed_gptrun(args, env, f"arm {arm}")
    log = COLOR.sub("", log)
    compiles = [float(s) * (60 if unit == "min" else 1) for _, s, unit in COMPILED.findall(log)]
    decisions = sorted({text.strip() for _, text in DECIDED.findall(log)})
    trials = load_trials(storage / name)
    return {
        "seconds": seconds,
        "compiles": compiles,
        "decisions": decisions,
        "startup": [t["startup_s"] for t in trials],
        "trials": len(trials),
        "best": min(t["val_loss"] for t in trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/configs/quickstart.toml")
    parser.add_argument(
        "--arms",
        type=comma_list(("false", "true", "auto")),
        default=["false", "true", "auto"],
        help="comma list of false, true, auto, run in that order",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    arms = args.arms
    root = Path(tempfile.mkdtemp(prefix="compile-sweep-"))
    env = {
        **os.environ,
        "GPTRUN_CACHE_DIR": str(root / "gptrun-cache"),  # no compile cost measured before
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "RAY_DEDUP_LOGS": "0",
    }
    results = {}
    for arm in arms:
        print(f"sweep with train.compile={arm} ...", flush=True)
        results[arm] = r = sweep_once(args.config, arm, root / "sweeps", args.set, env)
        compiles = ", ".join(f"{s:.1f}" for s in r["compiles"]) or "none"
        startup = statistics.median(r["startup"])
        print(
            f"  {r['trials']} trials in {r['seconds']:.0f} s, best val loss {r['best']:.4f}; "
            f"trial start-up median {startup:.1f} s; compile s per trial, in log order: {compiles}"
        )
        for line in r["decisions"]:
            print(f"  {line}")
    if "false" in results:
        for arm, r in results.items():
            if arm != "false":
                ratio = r["seconds"] / results["false"]["seconds"]
                print(f"ratio sweep wall-clock compile={arm} / compile=false: {ratio:.3f}x")


if __name__ == "__main__":
    main()
