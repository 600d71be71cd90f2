"""What a multi-node cluster costs a sweep: the same tiny sweep on a local Ray instance, on the
2-node cluster of `cluster/local.sh` (head + 1 worker node on this machine, token auth) and on an
autoscaling cluster that starts with no worker node (`cluster/local.sh up --autoscale`: a 0-CPU
head whose Ray autoscaler adds 1-CPU nodes), in the same run; and what a checkpoint costs in
object storage (an S3 server) against a local folder.

    python benchmarks/cluster_overhead.py [--trials 4] [--steps 40] [--concurrent 2] [--rounds 1]

For each side it launches `gptrun sweep CONFIG [--address ADDR]` as a subprocess and reports:
- launch -> first step: seconds from the launch to the earliest training step of any trial (the
  smallest `fit_start_unix` the trials report). Locally this includes starting a Ray instance;
  on the cluster, connecting to one that is already up (its `up` time is printed apart);
- trial start-up: each trial's seconds from its process being ready to its first step
  (`startup_s` of `experiments.results.load_trials`), median and max over the trials;
- the sweep's wall-clock.
with the ratio cluster / local; and for the autoscaling cluster, from 0 worker nodes each round,
how long its idle nodes take to go away once the sweep has ended (the sweep releases its
`request_resources`; the autoscaler removes a node after `--idle-timeout-s` idle). All sides run
the same config (a ~60k-parameter model on a
synthetic corpus prepared with `gptrun prepare`, 1-CPU trials, `--concurrent` at a time, no ASHA
cut). The cluster stays up (idle) while the local sweep runs, and local and cluster sweeps
alternate over `--rounds`, so all see the same background; the figures are medians over rounds.

The object-storage rows time one checkpoint's upload the way Ray Train and Tune persist it
(`pyarrow.fs.copy_files` into the run's storage, 64 MB chunks, no threads for S3) into a local
folder and into a bucket of a moto S3 server on 127.0.0.1 (`moto[server]`, in the dev extra),
alternated over `--checkpoint-rounds`: a real checkpoint of the sweep's model and a `--blob-mb`
file of random bytes (a bigger model's weights and optimizer state).
"""

from __future__ import annotations

import argparse
import json
import logging
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


def alive_workers(state: Path) -> int:
    """Worker nodes alive now, from `cluster/local.sh status` ("alive: N node(s)", head included)."""
    out = local_sh("status", state=state).stdout
    line = next(x for x in out.splitlines() if x.startswith("alive:"))
    return int(line.split()[1]) - 1


def wait_workers(state: Path, want: int, timeout: float) -> float:
    """Seconds until exactly `want` worker nodes are alive (polled about once a second)."""
    start = time.monotonic()
    while alive_workers(state) != want:
        if time.monotonic() - start > timeout:
            sys.exit(f"the autoscaling cluster did not reach {want} worker node(s) within {timeout:g}s")
        time.sleep(1.0)
    return time.monotonic() - start


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def print_table(sides: dict[str, list[dict[str, Any]]], flush: bool = False) -> None:
    """One column per side, then each side's ratio to the local one."""
    rows = [
        ("launch -> first step (s)", "first_step_s"),
        ("trial start-up, median (s)", "startup_median_s"),
        ("trial start-up, max (s)", "startup_max_s"),
        ("sweep wall-clock (s)", "wall_s"),
        ("idle nodes gone after (s)", "shrink_s"),
    ]
    names = list(sides)
    head = "".join(f"{n:>16}" for n in names) + "".join(f"{n + ' / ' + names[0]:>24}" for n in names[1:])
    print(f"{'':<28}{head}")
    for label, key in rows:
        values = [median_of(rows_, key) if key in rows_[0] else math.nan for rows_ in sides.values()]
        cells = "".join(f"{'-' if math.isnan(v) else f'{v:.1f}':>16}" for v in values)
        ratios = "".join(
            f"{'-' if math.isnan(v) or not values[0] > 0 else f'{v / values[0]:.2f}':>24}" for v in values[1:]
        )
        print(f"{label:<28}{cells}{ratios}", flush=flush)


def checkpoint_upload_times(
    config: Path, rounds: int, blob_mb: int, root: Path
) -> list[tuple[str, float, float]]:
    """Per-checkpoint upload seconds (median over `rounds`), local folder vs S3 (moto), alternated:
    [(what, local_s, s3_s)] for a real checkpoint of the sweep's model and a `blob_mb` MB file."""
    import boto3
    import pyarrow.fs
    from moto.server import ThreadedMotoServer

    from experiments.ray_config import load_experiment
    from gptcore.checkpoint import CHECKPOINT_FILE, save_checkpoint
    from gptcore.train import Trainer

    model = root / "ckpt-model"
    save_checkpoint(model / CHECKPOINT_FILE, Trainer(load_experiment(config), log=None).state_dict())
    blob = root / "ckpt-blob"
    blob.mkdir()
    (blob / CHECKPOINT_FILE).write_bytes(os.urandom(blob_mb * 1024 * 1024))

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request of the server
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="bench")
    s3 = pyarrow.fs.S3FileSystem(
        access_key="bench", secret_key="bench", region="us-east-1", endpoint_override=endpoint, scheme="http"
    )
    local = pyarrow.fs.LocalFileSystem()
    out: list[tuple[str, float, float]] = []
    try:
        for label, src in ((f"model checkpoint ({_mb(model)} MB)", model), (f"{blob_mb} MB file", blob)):
            times: dict[str, list[float]] = {"local": [], "s3": []}
            for k in range(rounds):
                for side, fs, dest in (
                    ("local", local, str(root / "uploads" / f"{src.name}-{k}")),
                    ("s3", s3, f"bench/{src.name}-{k}"),
                ):
                    start = time.perf_counter()
                    # As Ray persists a checkpoint (ray.train._internal.storage._upload_to_fs_path).
                    fs.create_dir(dest, recursive=True)
                    pyarrow.fs.copy_files(
                        str(src), dest, destination_filesystem=fs, use_threads=side == "local",
                        chunk_size=64 * 1024 * 1024,
                    )  # fmt: skip
                    times[side].append(time.perf_counter() - start)
            out.append((label, statistics.median(times["local"]), statistics.median(times["s3"])))
    finally:
        server.stop()
    return out


def _mb(folder: Path) -> str:
    return f"{sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Sweep start-up on a local Ray instance vs the 2-node cluster of cluster/local.sh "
        "vs an autoscaling cluster grown from no worker node, and a checkpoint's upload to an S3 "
        "server vs a local folder, measured in the same run."
    )
    parser.add_argument("--trials", type=int, default=4, help="trials per sweep (4)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per trial (40)")
    parser.add_argument("--concurrent", type=int, default=2, help="trials at a time on every side (2)")
    parser.add_argument(
        "--nodes", type=int, default=1, help="worker nodes of the static cluster besides the head (1)"
    )
    parser.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs per cluster node (1)")
    parser.add_argument(
        "--idle-timeout-s", type=float, default=10, help="the autoscaling cluster's idle timeout (10)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="sweeps per side, alternated (1)")
    parser.add_argument(
        "--checkpoint-rounds", type=int, default=5, help="uploads per checkpoint and side (5)"
    )
    parser.add_argument("--blob-mb", type=int, default=64, help="the larger checkpoint's size in MB (64)")
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
    grow_nodes = math.ceil(args.concurrent / args.cpus_per_node)  # what the trials at once need

    with tempfile.TemporaryDirectory(prefix="gptrun-overhead-") as tmp:
        root = Path(tmp)
        data = Path(args.data).resolve() if args.data else prepare_data(root, args.vocab_size)
        config = write_config(root, data, args.vocab_size, args.trials, args.steps, args.concurrent)
        static, elastic = root / "cluster", root / "autoscaling"
        start = time.monotonic()
        up = local_sh(
            "up", "--nodes", str(args.nodes), "--cpus-per-node", str(args.cpus_per_node), state=static
        )
        up_s = time.monotonic() - start
        sides: dict[str, list[dict[str, Any]]] = {
            "local": [],
            f"{args.nodes + 1} nodes": [],
            "autoscaling": [],
        }
        try:
            if up.returncode != 0:
                sys.exit(f"cluster/local.sh up failed:\n{up.stdout}{up.stderr}")
            grown = local_sh(
                "up", "--autoscale", str(grow_nodes), "--head-cpus", "0", "--cpus-per-node",
                str(args.cpus_per_node), "--idle-timeout-s", f"{args.idle_timeout_s:g}", state=elastic,
            )  # fmt: skip
            if grown.returncode != 0:
                sys.exit(f"cluster/local.sh up --autoscale failed:\n{grown.stdout}{grown.stderr}")
            runs = [
                ("local", clean_env(), None, None),
                (f"{args.nodes + 1}-nodes", *_client(static), None),
                ("autoscaling", *_client(elastic), elastic),
            ]
            for k in range(args.rounds):
                for (label, env, address, autoscaling), rows in zip(runs, sides.values(), strict=True):
                    if autoscaling is not None:
                        wait_workers(autoscaling, 0, 300)  # an empty cluster again
                    name = f"{label}-{k}"
                    rows.append(run_sweep(config, root / "sweeps", name, env, address, args.timeout))
                    if autoscaling is not None:
                        rows[-1]["shrink_s"] = wait_workers(autoscaling, 0, 300)
                print(
                    f"round {k}: "
                    + ", ".join(f"{label} {rows[-1]['first_step_s']:.1f}s" for label, rows in sides.items())
                    + " to the first step",
                    flush=True,
                )
        finally:
            for state in (elastic, static):
                if (state / "state.json").exists():
                    down = local_sh("down", "--grace", "10", state=state)
                    if down.returncode != 0:
                        print(f"warning: cluster/local.sh down: {down.stderr.strip()}", file=sys.stderr)
        print_sweeps(args, sides, up_s, grow_nodes)
        uploads = checkpoint_upload_times(config, args.checkpoint_rounds, args.blob_mb, root)
    print(f"\ncheckpoint upload, median of {args.checkpoint_rounds} (Ray's pyarrow.fs.copy_files):")
    print(f"{'':<28}{'local folder (s)':>18}{'S3, moto (s)':>16}{'S3/local':>10}")
    for label, local_s, s3_s in uploads:
        print(f"{label:<28}{local_s:>18.3f}{s3_s:>16.3f}{s3_s / local_s:>10.1f}")


def print_sweeps(
    args: argparse.Namespace, sides: dict[str, list[dict[str, Any]]], up_s: float, grow_nodes: int
) -> None:
    print(
        f"\n{args.trials} trials x {args.steps} steps (tiny model, batch {BATCH} x {SEQ_LEN} "
        f"tokens), {args.concurrent} at a time, 1 CPU each; median of {args.rounds} round(s); "
        f"cluster = head + {args.nodes} worker node(s) x {args.cpus_per_node} CPU(s), up in "
        f"{up_s:.1f}s (not counted); autoscaling = 0-CPU head, up to {grow_nodes} node(s) of "
        f"{args.cpus_per_node} CPU(s) added by Ray's autoscaler (fake multi-node provider), idle "
        f"timeout {args.idle_timeout_s:g}s"
    )
    print_table(sides, flush=True)


def _client(state: Path) -> tuple[dict[str, str], str]:
    """The environment and address of a client of the cluster whose state is in `state`."""
    info = json.loads((state / "state.json").read_text())
    return clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=info["token_path"]), info["address"]


if __name__ == "__main__":
    main()
