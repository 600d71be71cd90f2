#!/usr/bin/env bash
# A multi-node Ray cluster on this machine (head + N worker nodes, token auth, dashboard on
# 127.0.0.1), for trying gptrun on "several nodes" and for the tests. See cluster/README.md.
#
#   cluster/local.sh up [--nodes N] [--cpus-per-node C] [--head-cpus C] [--port P] [--dir DIR]
#   cluster/local.sh up --autoscale MAX [--head-cpus 0] [--idle-timeout-s S]   # Ray's autoscaler adds nodes
#   cluster/local.sh status [--dir DIR]      # address, nodes, resources (exit 1 if degraded)
#   cluster/local.sh down [--dir DIR]        # stops exactly what `up` started, checks none is left
#   cluster/local.sh kill-node NAME          # SIGKILL a worker node (simulate a lost machine)
#   cluster/local.sh start-node NAME         # start it (or a new worker node) again
#   cluster/local.sh env                     # the export line a client needs
#
# State (pids, ports, token) goes to --dir, $GPTRUN_CLUSTER_DIR or ./.cluster. The Python is
# $GPTRUN_PYTHON, else the repository's .venv, else python3 (it needs ray and gptrun installed).
set -euo pipefail

usage() {
    sed -n '5,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
}

case "${1:-}" in
    up | status | down | kill-node | start-node | env) ;;
    -h | --help) usage; exit 0 ;;
    "") usage; exit 2 ;;
    *)
        echo "cluster/local.sh: unknown command '${1}'; see cluster/local.sh --help" >&2
        exit 2
        ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${GPTRUN_PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/../.venv/bin/python" ]]; then
        python="$here/../.venv/bin/python"
    else
        python="$(command -v python3 || true)"
    fi
fi
if [[ -z "$python" ]] || ! "$python" -c "import ray, experiments" 2>/dev/null; then
    echo "cluster/local.sh: no Python with ray and gptrun found (set GPTRUN_PYTHON or run make install)" >&2
    exit 2
fi
exec "$python" "$here/local.py" "$@"
