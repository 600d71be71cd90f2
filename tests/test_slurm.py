"""cluster/slurm.sh as shipped, under a real Slurm (tests/slurm.py): `sbatch` with the EDIT values
as options and environment variables (the file is not edited) starts Ray on both nodes of the
allocation and runs a sweep; `scancel` mid-sweep and the same `sbatch` again resume it with no
trial lost or repeated; a loopback head address is refused in one line.

Two Slurm nodes, n1 and n2, on this one machine: two `slurmd -N` daemons (Slurm's multiple-slurmd
setup, which Debian's build runs), so the job gets a real two-node allocation and each Ray node
is a real `srun` step on its own Slurm node. Network namespaces (`ip netns` + veth) would also
give each node its own IP address, at the cost of root-only network setup (a bridge, addresses,
routes) on a machine the tests share; two slurmd need none. So both Ray nodes share the
machine's address: Ray's per-node ports are made free ones through RAY_HEAD_ARGS /
RAY_WORKER_ARGS, and each node's session folder is its own (RAY_TMP/<node>).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_ports, mid_trial_checkpoints, write_sweep_config
from tests.slurm import Slurm, slurm_cluster
from tests.test_sweep import assert_resumed_study, study_rows, trial_records

pytestmark = pytest.mark.slow

CPUS = 2  # per node: each trial takes a whole node (resources.cpus_per_worker=2)
N_TRIALS, STEPS, EVERY = 4, 200, 20


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    with slurm_cluster(("n1", "n2"), cpus=CPUS) as cluster:
        yield cluster


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Node-local scratch for Ray's session folders: short (Unix socket paths end at 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="gptrun-scratch-"))
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def job_env(slurm: Slurm, shared: Path, scratch: Path, **values: str) -> dict[str, str]:
    """The EDIT values of slurm.sh for this machine, as the environment sbatch exports."""
    ray_port, dashboard_port, client_port = free_ports(3)
    free = "--dashboard-agent-listen-port 0 --min-worker-port 0 --max-worker-port 0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env.update(
        slurm.env,
        SHARED=str(shared),
        VENV=sys.prefix,
        RAY_TMP=str(scratch),
        RAY_PORT=str(ray_port),
        DASHBOARD_PORT=str(dashboard_port),
        RAY_HEAD_ARGS=f"--ray-client-server-port {client_port} {free}",
        RAY_WORKER_ARGS=free,
        WAIT_S="120",
        **values,
    )
    return env


def sbatch(slurm: Slurm, env: dict[str, str], out: Path) -> str:
    """Submit cluster/slurm.sh as it is; options override its #SBATCH lines for this cluster."""
    options = [f"--nodes={len(slurm.nodes)}", f"--cpus-per-task={slurm.cpus_per_node}", "--gpus-per-node=0"]
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, f"--output={out}/job-%j.out", str(REPO / "cluster" / "slurm.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def output(folder: Path, job_id: str) -> str:
    path = folder / f"job-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def checkpointed_mid_trial(exp_dir: Path) -> dict[str, int]:
    """{trial id: step} of the unfinished trials whose checkpoint (at >= 2 intervals) is in Tune's
    saved experiment state: what a resume continues them from."""
    states = []
    for path in sorted(exp_dir.glob("experiment_state-*.json")):
        with contextlib.suppress(OSError):  # being replaced
            states.append(path.read_text())
    return mid_trial_checkpoints(states, 2 * EVERY, STEPS)


def processes_under(folder: Path) -> list[int]:
    """Live processes whose command line names `folder` (Ray's, through their session folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # gone meanwhile
            continue
    return found


def environment(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        pairs = (Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")).split("\0")
        return dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    return {}


def wait_until(condition, timeout: float, what: str, job: tuple[Slurm, str, Path], running: bool = True):
    """condition()'s first truthy value; fails with the job's output if it takes too long, or if
    the job ends first when it should be `running`."""
    slurm, job_id, folder = job
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if running:
            state = slurm.job(job_id)["JobState"]
            assert state in ("PENDING", "RUNNING"), (
                f"job {state} before {what}:\n{output(folder, job_id)[-4000:]}"
            )
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout:g}s:\n{output(folder, job_id)[-4000:]}")


def assert_one_ray_step_per_node(slurm: Slurm, job_id: str, scratch: Path) -> None:
    """Each Ray node is one `srun` step on its own Slurm node, one task with all the task's CPUs
    (-c: Slurm >= 22.05 no longer passes --cpus-per-task to steps), its session folder in the
    node's scratch."""
    steps = {s["Name"]: s for s in slurm.steps(job_id) if s["Name"].startswith("ray-")}
    assert set(steps) == {"ray-head", "ray-worker"}, steps
    for name, node in (("ray-head", "n1"), ("ray-worker", "n2")):
        assert steps[name]["NodeList"] == node, steps[name]
        assert (steps[name]["Nodes"], steps[name]["Tasks"]) == ("1", "1"), steps[name]
        assert steps[name].get("TresPerTask") == f"cpu:{CPUS}", steps[name]
        assert list((scratch / node).glob("session_*")), f"no Ray session folder in {scratch / node}"


def assert_every_ray_process_has_the_jobs_token(token: Path, scratch: Path) -> None:
    """The token file is 0600 in a 0700 folder, and every Ray process reads it (and no stray
    RAY_AUTH_TOKEN, which would win over the file)."""
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.parent.stat().st_mode) == 0o700
    ray_envs = [environment(pid) for pid in processes_under(scratch)]
    assert len(ray_envs) >= 4, ray_envs  # at least ray start, GCS and a raylet per node
    for ray_env in filter(None, ray_envs):
        assert ray_env["RAY_AUTH_MODE"] == "token" and ray_env["RAY_AUTH_TOKEN_PATH"] == str(token)
        assert "RAY_AUTH_TOKEN" not in ray_env


def test_sbatch_runs_a_sweep_on_two_nodes_and_resumes_it_after_scancel(slurm, tiny_data, tmp_path, scratch):
    shared = tmp_path / "shared"
    shared.mkdir()
    config = write_sweep_config(tiny_data, tmp_path, n=N_TRIALS, max_steps=STEPS)
    sets = {
        "sweep.grace_tokens": "100000000",  # no ASHA stop: every trial runs to STEPS
        "train.eval_interval": str(EVERY),
        "resources.cpus_per_worker": str(CPUS),
        "train.num_threads": "1",  # 2 nodes' trials on this machine's cores
    }
    sweep_args = " ".join(f"--set {key}={value}" for key, value in sets.items())
    env = job_env(slurm, shared, scratch, CONFIG=str(config), NAME="demo", SWEEP_ARGS=sweep_args)
    env["RAY_AUTH_TOKEN"] = "a-stray-token"  # would override the job's token file if left set
    exp_dir = shared / "sweeps" / "demo"

    first = sbatch(slurm, env, tmp_path)
    job = (slurm, first, tmp_path)
    wait_until(lambda: (exp_dir / "tuner.pkl").exists(), 240, "sweep", job)
    text = output(tmp_path, first)
    head = re.search(r"^Ray head on n1 \(([\d.]+):(\d+)\)", text, re.M)
    assert head and not head.group(1).startswith("127."), text[-3000:]  # not Debian's 127.0.1.1
    assert f"Ray cluster ready: 2 node(s), {2 * CPUS} CPUs" in text, text[-3000:]
    assert_one_ray_step_per_node(slurm, first, scratch)
    token = shared / ".gptrun-ray" / first / "token"
    assert_every_ray_process_has_the_jobs_token(token, scratch)

    wait_until(lambda: checkpointed_mid_trial(exp_dir), 240, "checkpoint mid-trial", job)
    assert slurm.command("scancel", first).returncode == 0
    assert slurm.wait_job(first, 120)["JobState"] == "CANCELLED"
    assert not token.parent.exists(), "the job's token outlived it"
    wait_until(lambda: not processes_under(scratch), 60, "end of the Ray processes", job, running=False)
    interrupted = checkpointed_mid_trial(exp_dir)  # Tune's last word before the cancel
    assert interrupted

    second = sbatch(slurm, env, tmp_path)  # the same submission: resumes the sweep
    ended = slurm.wait_job(second, 300)
    text = output(tmp_path, second)
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert f"resuming {exp_dir}" in text and "best trial" in text, text[-4000:]
    after = trial_records(exp_dir)
    assert len(after) == N_TRIALS and all(recs[-1]["step"] == STEPS for recs in after.values()), after
    for trial_id, step in interrupted.items():  # from its checkpoint, not from step 0
        resumed = [r["resumed_from"] for r in after[trial_id] if r.get("resumed_from", 0) > 0]
        assert resumed and step <= resumed[0] < STEPS, (trial_id, step, resumed)
    assert_resumed_study(study_rows(exp_dir), after)
    assert len({recs[-1]["node_id"] for recs in after.values()}) == 2  # trials ran on both nodes
    assert not processes_under(scratch)
    assert not (shared / ".gptrun-ray" / second).exists()


def test_a_loopback_head_address_is_refused_in_one_line(slurm, tmp_path, scratch):
    """What Debian's /etc/hosts makes of `hostname --ip-address` (127.0.1.1): refused before any
    Ray starts, and the job's token, written before the check, is deleted on the way out."""
    shared = tmp_path / "shared"
    shared.mkdir()
    env = job_env(slurm, shared, scratch, HEAD_IP="127.0.1.1", CONFIG="unused.toml", SWEEP_ARGS="")
    job_id = sbatch(slurm, env, tmp_path)
    ended = slurm.wait_job(job_id, 60)
    text = output(tmp_path, job_id)
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "1:0"), text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm.sh: error: HEAD_IP=127.0.1.1 is a loopback"), text
    assert (shared / ".gptrun-ray").is_dir()  # the token was written...
    assert not (shared / ".gptrun-ray" / job_id).exists()  # ...and deleted by the trap
