"""What a multi-node cluster costs a sweep: the same tiny sweep on a local Ray instance and on the
2-node cluster of `cluster/local.sh` (head + 1 worker node on this machine, token auth), in the
same run.

    python benchmarks/cluster_overhead.py [--trials 4] [--steps 40] [--concurrent 2] [--rounds 1]

For each side it launches `gptrun sweep CONFIG [--address ADDR]` as a subprocess and reports:
- launch -> first step: seconds from the launch to the earliest training step of any trial (the
  smallest `fit_start_unix` the trials report). Locally this includes starting a Ray instance;
  on the cluster, connecting to one that is already up (its `up` time is printed apart);
- trial start-up: each trial's seconds from its process being ready to its first step
  (`startup_s` of `experiments.results.load_trials`), median and max over the trials;
- the sweep's wall-clock.
with the ratio cluster / local. Both sides run the same config (a ~60k-parameter model on a
synthetic corpus prepared with `gptrun prepare`, 1-CPU trials, `--concurrent` at a time, no ASHA
cut). The cluster stays up (idle) while the local sweep runs, and local and cluster sweeps
alternate over `--rounds`, so both see the same background; the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCAL_SH = REPO / "cluster" / "local.sh"
AUTH_VARS = (
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_API_SERVER_ADDRESS",
)
WORDS = (
    "the king queen speaks to a fool and lord of night day sword crown love death "
    "sweet good my thy thee doth hath shall not is was her his"
).split()
SEQ_LEN, BATCH = 32, 4


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Ray address or token: each side sets its own."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def gptrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "experiments", *args]


def prepare_data(root: Path, vocab: int) -> Path:
    """A synthetic English-like corpus (as in tests/conftest.py), prepared by `gptrun prepare`."""
    rng = random.Random(0)
    docs = []
    for _ in range(200):
        lines = [
            f"{rng.choice(('KING', 'QUEEN', 'FOOL', 'LORD'))}: "
            + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize()
            + "."
            for _ in range(rng.randint(8, 16))
        ]
        docs.append("\n".join(lines))
    corpus = root / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(docs), encoding="utf-8")
    out = root / "data"
    proc = subprocess.run(
        gptrun(
            "prepare",
            "--input",
            str(corpus),
            "--out",
            str(out),
            "--vocab-size",
            str(vocab),
            "--val-fraction",
            "0.1",
        ),
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"gptrun prepare failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def write_config(root: Path, data: Path, vocab: int, trials: int, steps: int, concurrent: int) -> Path:
    """A sweep of `trials` tiny 1-CPU trials of `steps` steps, ASHA's first rung at the end (no
    trial is cut, so both sides train the same tokens)."""
    tokens = BATCH * SEQ_LEN * steps
    config = root / "overhead.toml"
    config.write_text(f"""name = "overhead"

[model]
preset = "tiny"
vocab_size = {vocab}
seq_len = {SEQ_LEN}

[data]
dir = "{data}"

[optim]
lr = 3e-3
warmup = 0.1
weight_decay = 0.1

[train]
batch_size = {BATCH}
max_steps = {steps}
eval_interval = {max(1, steps // 2)}
eval_tokens = 2048
log_interval = {max(1, steps // 2)}
device = "cpu"
out = "{root / "run"}"

[resources]
workers = 1
cpus_per_worker = 1

[sweep]
num_samples = {trials}
seed = 3
max_concurrent = {concurrent}
reduction_factor = 3
grace_tokens = {tokens}

[sweep.space]
lr = {{ loguniform = [1e-4, 3e-2] }}
weight_decay = {{ loguniform = [1e-3, 0.3], include_zero = true }}
warmup = {{ uniform = [0.0, 0.3] }}
""")
    return config


def first_step_unix(exp_dir: Path) -> float:
    """The earliest `fit_start_unix` any trial reported (its loop's first step)."""
    starts = []
    for path in exp_dir.glob("*/result.json"):
        for line in path.read_text().splitlines():
            if line.strip():
                value = json.loads(line).get("fit_start_unix")
                if value:
                    starts.append(float(value))
    if not starts:
        sys.exit(f"no trial of {exp_dir} reported a first step")
    return min(starts)


def run_sweep(
    config: Path, storage: Path, name: str, env: dict[str, str], address: str | None, timeout: float
) -> dict[str, Any]:
    """Launch `gptrun sweep` and measure it: launch -> first step, trial start-ups, wall."""
    from experiments.results import load_trials

    args = gptrun("sweep", str(config), "--name", name, "--storage", str(storage))
    if address:
        args += ["--address", address]
    log = storage / f"{name}.log"
    storage.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        launched = time.time()
        proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sys.exit(f"{name}: the sweep took more than {timeout:g}s; log: {log}")
        wall = time.time() - launched
    if code != 0:
        sys.exit(f"{name}: gptrun sweep exited {code}:\n{log.read_text()[-3000:]}")
    exp_dir = storage / name
    startups = [t["startup_s"] for t in load_trials(exp_dir) if not math.isnan(t["startup_s"])]
    if not startups:
        sys.exit(f"{name}: no trial start-up measured; log: {log}")
    return {
        "first_step_s": first_step_unix(exp_dir) - launched,
        "startup_median_s": statistics.median(startups),
        "startup_max_s": max(startups),
        "trials": len(startups),
        "wall_s": wall,
    }


def local_sh(*args: str, state: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LOCAL_SH), *args, "--dir", str(state)],
        cwd=REPO,
        timeout=timeout,
        env=clean_env(GPTRUN_PYTHON=sys.executable),
        capture_output=True,
        text=True,
    )


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def print_table(local: list[dict[str, Any]], cluster: list[dict[str, Any]], nodes: int) -> None:
    rows = [
        ("launch -> first step (s)", "first_step_s"),
        ("trial start-up, median (s)", "startup_median_s"),
        ("trial start-up, max (s)", "startup_max_s"),
        ("sweep wall-clock (s)", "wall_s"),
    ]
    print(f"{'':<28} {'local Ray':>10} {f'{nodes}-node cluster':>15} {'cluster/local':>14}")
    for label, key in rows:
        a, b = median_of(local, key), median_of(cluster, key)
        ratio = f"{b / a:.2f}" if a > 0 else "-"
        print(f"{label:<28} {a:>10.1f} {b:>15.1f} {ratio:>14}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Sweep start-up on a local Ray instance vs the 2-node cluster of "
        "cluster/local.sh, measured in the same run."
    )
    parser.add_argument("--trials", type=int, default=4, help="trials per sweep (4)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per trial (40)")
    parser.add_argument("--concurrent", type=int, default=2, help="trials at a time on both sides (2)")
    parser.add_argument(
        "--nodes", type=int, default=1, help="worker nodes of the cluster besides the head (1)"
    )
    parser.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs per cluster node (1)")
    parser.add_argument("--rounds", type=int, default=1, help="local / cluster sweep pairs, alternated (1)")
    parser.add_argument(
        "--data", default=None, help="a prepared data folder (default: a synthetic corpus prepared here)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=384, help="the vocabulary of --data (384 for the synthetic corpus)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per sweep (900)")
    args = parser.parse_args()
    if min(args.trials, args.steps, args.concurrent, args.rounds, args.cpus_per_node) < 1 or args.nodes < 1:
        parser.error("--trials, --steps, --concurrent, --rounds, --nodes and --cpus-per-node must be >= 1")
    cluster_cpus = (args.nodes + 1) * args.cpus_per_node
    if cluster_cpus < args.concurrent:
        parser.error(
            f"the cluster has {cluster_cpus} CPUs: fewer than --concurrent {args.concurrent} one-CPU trials"
        )

    with tempfile.TemporaryDirectory(prefix="gptrun-overhead-") as tmp:
        root = Path(tmp)
        data = Path(args.data).resolve() if args.data else prepare_data(root, args.vocab_size)
        config = write_config(root, data, args.vocab_size, args.trials, args.steps, args.concurrent)
        state = root / "cluster"
        start = time.monotonic()
        up = local_sh(
            "up", "--nodes", str(args.nodes), "--cpus-per-node", str(args.cpus_per_node), state=state
        )
        up_s = time.monotonic() - start
        local_rows: list[dict[str, Any]] = []
        cluster_rows: list[dict[str, Any]] = []
        try:
            if up.returncode != 0:
                sys.exit(f"cluster/local.sh up failed:\n{up.stdout}{up.stderr}")
            info = json.loads((state / "state.json").read_text())
            cluster_env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=info["token_path"])
            for k in range(args.rounds):
                local_rows.append(
                    run_sweep(config, root / "sweeps", f"local-{k}", clean_env(), None, args.timeout)
                )
                cluster_rows.append(
                    run_sweep(
                        config, root / "sweeps", f"cluster-{k}", cluster_env, info["address"], args.timeout
                    )
                )
                print(
                    f"round {k}: local {local_rows[-1]['first_step_s']:.1f}s, cluster "
                    f"{cluster_rows[-1]['first_step_s']:.1f}s to the first step",
                    flush=True,
                )
        finally:
            down = local_sh("down", "--grace", "10", state=state)
            if down.returncode != 0:
                print(f"warning: cluster/local.sh down: {down.stderr.strip()}", file=sys.stderr)

    print(
        f"\n{args.trials} trials x {args.steps} steps (tiny model, batch {BATCH} x {SEQ_LEN} "
        f"tokens), {args.concurrent} at a time, 1 CPU each; median of {args.rounds} round(s); "
        f"cluster = head + {args.nodes} worker node(s) x {args.cpus_per_node} CPU(s), up in "
        f"{up_s:.1f}s (not counted)"
    )
    print_table(local_rows, cluster_rows, args.nodes + 1)


if __name__ == "__main__":
    main()
