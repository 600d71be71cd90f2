#!/usr/bin/env bash
# gptrun on a Slurm allocation: one Ray cluster per job (head on the first node, a worker on each
# of the others, token auth, dashboard on 127.0.0.1), then one `gptrun sweep` on it. Submitting
# the same job again resumes the sweep (`gptrun resume`) from the trials' checkpoints.
#
# Needs: the same Python environment with gptrun installed on every node (a venv on the shared
# filesystem is easiest), and a folder every node mounts at the same path ($SHARED). Set the
# values marked EDIT (the #SBATCH lines and the defaults below) by editing them or, without
# touching this file, as sbatch options and environment variables: options on the command line
# override the #SBATCH lines, `--export=ALL,NAME=value,...` sets the variables. On a login node,
# in the repository root (CONFIG is read from the submit directory):
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
# Bash 4.2 (RHEL/CentOS 7) counts "${a[@]}" of an empty array as unbound under `set -u`: every
# array that may be empty is expanded as ${a[@]+"${a[@]}"}.

SHARED="${SHARED:-/shared/$USER}"                        # EDIT: mounted on every node
VENV="${VENV:-$SHARED/gptrun/.venv}"                     # EDIT: gptrun's venv, on $SHARED
CONFIG="${CONFIG:-experiments/configs/minimind-26m.toml}"
NAME="${NAME:-minimind-26m}"                             # the sweep folder: $SHARED/sweeps/NAME
# Extra `gptrun sweep` arguments, split on spaces (no quoting; set it empty for none).
SWEEP_ARGS="${SWEEP_ARGS---set data.dir=$SHARED/data/shakespeare}"
# The head's address on the network the nodes share (EDIT for another interface, e.g. IPoIB).
# Default: the first non-loopback IPv4 address of the head node; a loopback one is refused.
HEAD_IP="${HEAD_IP:-}"
# Ray's session folders (logs, sockets, spilled objects), one per node under RAY_TMP: EDIT to
# node-local scratch if $TMPDIR is not. Keep it short: Unix socket paths end at 107 bytes.
RAY_TMP="${RAY_TMP:-${TMPDIR:-/tmp}/ray-${SLURM_JOB_ID:-}}"
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
# Extra `ray start` options for the head / each worker node, split on spaces (no quoting), e.g.
# --object-store-memory BYTES, or other ports (--ray-client-server-port, --min-worker-port ...).
RAY_HEAD_ARGS="${RAY_HEAD_ARGS:-}"
RAY_WORKER_ARGS="${RAY_WORKER_ARGS:-}"
WAIT_S="${WAIT_S:-300}"                                  # for the head, then for all nodes

die() {
    echo "slurm.sh: error: $*" >&2
    exit 1
}

[[ -n "${SLURM_JOB_ID:-}" ]] || die "run this through sbatch (no SLURM_JOB_ID)"
[[ -x "$VENV/bin/python" ]] || die "no Python at $VENV/bin/python (set VENV)"
# The venv's commands first on PATH (what `activate` does); srun passes this environment (PATH,
# the token variables) to the steps on every node.
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
PYTHON="$VENV/bin/python"
SWEEPS="$SHARED/sweeps"
SWEEP_DIR="$SWEEPS/$NAME"
RUN_DIR="$SHARED/.gptrun-ray/$SLURM_JOB_ID"
read -r -a sweep_args <<< "$SWEEP_ARGS"
read -r -a head_args <<< "$RAY_HEAD_ARGS"
read -r -a worker_args <<< "$RAY_WORKER_ARGS"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${#nodes[@]} > 0)) || die "scontrol found no node in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
head_node="${nodes[0]}"
# Slurm >= 22.05 no longer hands --cpus-per-task down to srun steps: each `srun` passes -c.
cpus="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}"
gpu_args=()
if [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then   # "8" or "a100:8"; unset: Ray detects the GPUs
    gpu_args=(--num-gpus "${SLURM_GPUS_PER_NODE##*:}")
fi

head_pid=""
worker_pids=()
sweep_pid=""

# Set before anything is written or started: every exit (an error, scancel, the time limit)
# stops what this job started and deletes its token.
stop_all() {
    local rc=$? pid deadline
    trap - EXIT INT TERM
    rm -rf "$RUN_DIR"   # first: on scancel, Slurm kills this script KillWait seconds after TERM
    if [[ -n "$sweep_pid" ]] && kill -0 "$sweep_pid" 2>/dev/null; then
        echo "stopping the sweep driver (resubmit the job to resume it)"
        kill -TERM "$sweep_pid" 2>/dev/null || true
    fi
    # srun ends its step on TERM (its task gets SIGKILL): Ray stops on every node.
    for pid in ${worker_pids[@]+"${worker_pids[@]}"} $head_pid; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    deadline=$((SECONDS + 30))
    for pid in $sweep_pid ${worker_pids[@]+"${worker_pids[@]}"} $head_pid; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    if [[ -n "$head_pid" ]]; then
        rm -rf "${RAY_TMP:?}/$head_node"   # this node's; other nodes' stay in their scratch
        echo "Ray stopped on ${#nodes[@]} node(s); exit status $rc"
    fi
    exit "$rc"
}
trap stop_all EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# ---------------------------------------------------------------- token (every process)
(umask 077 && mkdir -p "$RUN_DIR" && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' \
    > "$RUN_DIR/token")
chmod 600 "$RUN_DIR/token"
unset RAY_AUTH_TOKEN RAY_ADDRESS   # a stray value would override the token file / the address
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RUN_DIR/token" RAY_USAGE_STATS_ENABLED=0
# On TERM (scancel, the end of the job) Ray would drain each node for 30 s, for Ray Serve, and be
# killed by Slurm halfway through (KillWait); trials resume from their checkpoints anyway.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0

# ---------------------------------------------------------------- the head's address
# Not `hostname --ip-address`: it reads /etc/hosts, which on Debian-style systems maps the
# host name to 127.0.1.1, an address no other node can reach.
if [[ -z "$HEAD_IP" ]]; then
    addresses="$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --all-ip-addresses)"
    for address in $addresses; do
        if [[ "$address" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ && "$address" != 127.* ]]; then
            HEAD_IP="$address"
            break
        fi
    done
    [[ -n "$HEAD_IP" ]] || die "$head_node has no non-loopback IPv4 address (hostname -I:" \
        "${addresses:-none}); set HEAD_IP to the address the other nodes reach it at"
fi
if [[ "$HEAD_IP" == 127.* || "$HEAD_IP" == ::1 || "$HEAD_IP" == localhost ]] && ((${#nodes[@]} > 1)); then
    die "HEAD_IP=$HEAD_IP is a loopback address, which the other nodes cannot reach; set HEAD_IP" \
        "to $head_node's address on the cluster network (see \`hostname -I\` there)"
fi
ray_address="$HEAD_IP:$RAY_PORT"

# ---------------------------------------------------------------- head, then workers
# One step per node, as Ray's own Slurm template: --nodes=1 --ntasks=1 on that node, all its CPUs.
node_args=(--block --disable-usage-stats --num-cpus "$cpus" ${gpu_args[@]+"${gpu_args[@]}"})
echo "Ray head on $head_node ($ray_address), ${#nodes[@]} node(s), $cpus CPUs each"
srun --nodes=1 --ntasks=1 -c "$cpus" -w "$head_node" --job-name=ray-head \
    ray start --head --node-ip-address "$HEAD_IP" --port "$RAY_PORT" \
    --temp-dir "$RAY_TMP/$head_node" "${node_args[@]}" \
    --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" \
    ${head_args[@]+"${head_args[@]}"} &
head_pid=$!

deadline=$((SECONDS + WAIT_S))
until (exec 3<>"/dev/tcp/$HEAD_IP/$RAY_PORT") 2>/dev/null; do
    kill -0 "$head_pid" 2>/dev/null || die "the Ray head exited; see its output above"
    ((SECONDS < deadline)) || die "the Ray head did not listen on $ray_address within ${WAIT_S}s"
    sleep 2
done

for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -c "$cpus" -w "$node" --job-name=ray-worker \
        ray start --address "$ray_address" --temp-dir "$RAY_TMP/$node" "${node_args[@]}" \
        ${worker_args[@]+"${worker_args[@]}"} &
    worker_pids+=($!)
done

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
        --restart ${sweep_args[@]+"${sweep_args[@]}"} &
else
    gptrun sweep "$CONFIG" --name "$NAME" --address "$ray_address" --storage "$SWEEPS" \
        ${sweep_args[@]+"${sweep_args[@]}"} &
fi
sweep_pid=$!
wait "$sweep_pid"   # in the background, so that TERM (scancel, the time limit) is handled now
