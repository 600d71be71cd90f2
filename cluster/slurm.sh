#!/usr/bin/env bash
# gptrun on a Slurm allocation: one Ray cluster per job (head on the first node, a worker on each
# of the others, token auth, dashboard on 127.0.0.1), then one `gptrun sweep` on it. Submitting
# the same job again resumes the sweep (`gptrun resume`) from the trials' checkpoints.
#
# Needs: the same Python environment with gptrun installed on every node (a venv on the shared
# filesystem is easiest), and a folder every node mounts at the same path ($SHARED). Edit the
# lines marked EDIT (the #SBATCH lines and the defaults below), then, on a login node in the
# repository root (CONFIG is read from the submit directory):
#
#   gptrun prepare --corpus shakespeare --out /shared/$USER/data/shakespeare      # once
#   sbatch --export=ALL,CONFIG=experiments/configs/minimind-26m.toml,NAME=minimind-26m \
#       cluster/slurm.sh
#   tail -f gptrun-<jobid>.out
#   sbatch --export=ALL,CONFIG=...,NAME=minimind-26m cluster/slurm.sh   # again: resumes it
#
# The dashboard listens on the head node's 127.0.0.1 only: tunnel to it through the login node,
#   ssh -L 8265:127.0.0.1:8265 -J <login-node> <head-node>      # then http://localhost:8265
# and never open 6379 (GCS), 8265 (dashboard) or 10001 (Ray Client) beyond the cluster's network.
# The token is per job, in $SHARED/.gptrun-ray/<jobid>/token (mode 0600), deleted at the end.
#
# EDIT the #SBATCH lines (sbatch reads them up to the first command; keep comments on their own
# lines, older Slurm takes text after an option as more options): nodes (the first one also
# runs the sweep driver), GPUs per node (--gres=gpu:8 on older Slurm), CPUs per node given to
# Ray, the wall-clock limit (resubmit to go on after it), whole nodes (no other job's Ray on the
# same ports), and your partition / account / qos if the site needs them. 2 minutes before the
# limit Slurm sends TERM to this script, which stops the sweep driver and Ray cleanly.
#SBATCH --job-name=gptrun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --exclusive
#SBATCH --signal=B:TERM@120
#SBATCH --output=gptrun-%j.out
##SBATCH --partition=gpu

set -euo pipefail

SHARED="${SHARED:-/shared/$USER}"                        # EDIT: mounted on every node
VENV="${VENV:-$SHARED/gptrun/.venv}"                     # EDIT: gptrun's venv, on $SHARED
CONFIG="${CONFIG:-experiments/configs/minimind-26m.toml}"
NAME="${NAME:-minimind-26m}"                             # the sweep folder: $SHARED/sweeps/NAME
# Extra `gptrun sweep` arguments, split on spaces (no quoting): --set KEY=VALUE ...
SWEEP_ARGS="${SWEEP_ARGS:---set data.dir=$SHARED/data/shakespeare}"
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
WAIT_S="${WAIT_S:-300}"                                  # for the head, then for all nodes

die() {
    echo "slurm.sh: error: $*" >&2
    exit 1
}

[[ -n "${SLURM_JOB_ID:-}" ]] || die "run this through sbatch (no SLURM_JOB_ID)"
[[ -x "$VENV/bin/python" ]] || die "no Python at $VENV/bin/python (set VENV)"
# shellcheck disable=SC1091
source "$VENV/bin/activate"  # srun passes this environment (PATH, token variables) to each node
PYTHON="$VENV/bin/python"
SWEEPS="$SHARED/sweeps"
SWEEP_DIR="$SWEEPS/$NAME"
read -r -a extra_args <<< "$SWEEP_ARGS"

# ---------------------------------------------------------------- token (every process)
RUN_DIR="$SHARED/.gptrun-ray/$SLURM_JOB_ID"
(umask 077 && mkdir -p "$RUN_DIR" && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' \
    > "$RUN_DIR/token")
chmod 600 "$RUN_DIR/token"
unset RAY_AUTH_TOKEN RAY_ADDRESS   # a stray value would override the token file / the address
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RUN_DIR/token" RAY_USAGE_STATS_ENABLED=0

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node="${nodes[0]}"
head_ip="${HEAD_IP:-$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address \
    | awk '{print $1}')}"                                # EDIT: HEAD_IP for another interface
ray_address="$head_ip:$RAY_PORT"
cpus="${SLURM_CPUS_PER_TASK:-1}"
gpu_args=()
if [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then   # "8" or "a100:8"; unset: Ray detects the GPUs
    gpu_args=(--num-gpus "${SLURM_GPUS_PER_NODE##*:}")
fi

head_pid=""
workers_pid=""
sweep_pid=""

stop_all() {
    local rc=$? pid deadline
    trap - EXIT INT TERM
    if [[ -n "$sweep_pid" ]] && kill -0 "$sweep_pid" 2>/dev/null; then
        echo "stopping the sweep driver (resubmit the job to resume it)"
        kill -TERM "$sweep_pid" 2>/dev/null || true
    fi
    # srun forwards SIGTERM to its tasks: each `ray start --block` stops its node's processes.
    for pid in $workers_pid $head_pid; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    deadline=$((SECONDS + 30))
    for pid in $sweep_pid $workers_pid $head_pid; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    ray stop --force >/dev/null 2>&1 || true   # whatever is left on this (the head) node
    rm -rf "$RUN_DIR"
    echo "Ray stopped on ${#nodes[@]} node(s); exit status $rc"
    exit "$rc"
}
trap stop_all EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# ---------------------------------------------------------------- head, then workers
echo "Ray head on $head_node ($ray_address), ${#nodes[@]} node(s), $cpus CPUs each"
srun --nodes=1 --ntasks=1 -w "$head_node" \
    ray start --head --block --disable-usage-stats --node-ip-address "$head_ip" \
    --port "$RAY_PORT" --num-cpus "$cpus" "${gpu_args[@]}" \
    --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" &
head_pid=$!

deadline=$((SECONDS + WAIT_S))
until (exec 3<>"/dev/tcp/$head_ip/$RAY_PORT") 2>/dev/null; do
    kill -0 "$head_pid" 2>/dev/null || die "the Ray head exited; see its output above"
    ((SECONDS < deadline)) || die "the Ray head did not listen on $ray_address within ${WAIT_S}s"
    sleep 2
done

if ((${#nodes[@]} > 1)); then
    srun --nodes=$((${#nodes[@]} - 1)) --ntasks-per-node=1 --exclude="$head_node" \
        ray start --block --disable-usage-stats --address "$ray_address" \
        --num-cpus "$cpus" "${gpu_args[@]}" &
    workers_pid=$!
fi

# Every node alive in the head's view, within WAIT_S seconds (this driver exits; Ray stays).
"$PYTHON" - "$ray_address" "${#nodes[@]}" "$WAIT_S" <<'EOF'
import sys
import time

import ray

address, want, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + wait
ray.init(address=address, logging_level="error", log_to_driver=False)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        total = ray.cluster_resources()
        print(f"Ray cluster ready: {len(alive)} node(s), {total.get('CPU', 0):g} CPUs, "
              f"{total.get('GPU', 0):g} GPUs")
        break
    if time.monotonic() > deadline:
        sys.exit(f"slurm.sh: error: {len(alive)} of {want} nodes joined within {wait:g}s")
    time.sleep(2)
EOF

# ---------------------------------------------------------------- the sweep (or its resume)
export RAY_ADDRESS="$ray_address"
if [[ -f "$SWEEP_DIR/tuner.pkl" ]]; then
    echo "resuming $SWEEP_DIR"
    gptrun resume "$SWEEP_DIR" --address "$ray_address" &
elif [[ -d "$SWEEP_DIR" ]]; then   # killed before Tune saved any state: nothing to lose
    echo "$SWEEP_DIR has no Tune state yet: starting it over"
    gptrun sweep "$CONFIG" --name "$NAME" --address "$ray_address" --storage "$SWEEPS" \
        --restart "${extra_args[@]}" &
else
    gptrun sweep "$CONFIG" --name "$NAME" --address "$ray_address" --storage "$SWEEPS" \
        "${extra_args[@]}" &
fi
sweep_pid=$!
wait "$sweep_pid"   # in the background, so that TERM (scancel, the time limit) is handled now
