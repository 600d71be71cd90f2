"""A real, throwaway Slurm cluster for the tests: Debian's `munge`, `slurmctld`, `slurmd` and
`slurm-client` (installed by `make test` when missing), started as root in a temp folder on free
ports, and stopped (by pid) at the end.

Everything lives in the temp folder: munged's key, socket, pid and log files (`--key-file`,
`--socket`, ...: not /etc/munge or /run/munge), slurm.conf (clients find it through
`SLURM_CONF`, which every command below gets), the controller's state, each node's spool
folder, pid file and log. Two nodes on one machine: Debian's Slurm runs one `slurmd -N NAME`
per node name, each on its own port, all answering at 127.0.0.1 (Slurm's "multiple slurmd"
setup), so jobs and steps are scheduled, started and cancelled by the real daemons as on a
cluster; only the network and the disk are shared. `TaskPlugin=task/none` and
`ProctrackType=proctrack/linuxproc` need no cgroups; `SlurmdParameters=config_overrides` lets
a node declare CPUs it does not have. Anything that stops the cluster from starting fails the
test with the reason: these tests must exercise Slurm, never skip it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
FINAL_STATES = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


@dataclass(frozen=True)
class Slurm:
    root: Path
    nodes: tuple[str, ...]
    cpus_per_node: int

    @property
    def env(self) -> dict[str, str]:
        """What every Slurm client command needs to find this cluster."""
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def command(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return subprocess.run(
            list(args), capture_output=True, text=True, timeout=60, env={**base, **(env or {}), **self.env}
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...)."""
        proc = self.command("scontrol", "show", "job", "-o", job_id)
        assert proc.returncode == 0, proc.stderr
        return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)

    def steps(self, job_id: str) -> list[dict[str, str]]:
        """The job's running steps, one dict per `scontrol show step` record."""
        proc = self.command("scontrol", "show", "step", "-o", job_id)
        assert proc.returncode == 0, proc.stderr
        return [
            dict(field.split("=", 1) for field in line.split() if "=" in field)
            for line in proc.stdout.splitlines()
            if line.strip()
        ]

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """The job's record once it has ended (and its processes are gone: not COMPLETING)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] in FINAL_STATES:
                return job
            time.sleep(0.5)
        raise AssertionError(f"Slurm job {job_id} still {job['JobState']} after {timeout:g}s")


def check_binaries() -> None:
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        raise RuntimeError(
            f"no Slurm here ({', '.join(missing)} not found): `make test` installs Debian's slurmctld, "
            "slurmd, slurm-client and munge packages as root; elsewhere run `apt-get install slurmctld "
            "slurmd slurm-client munge`"
        )
    if os.geteuid() != 0:
        raise RuntimeError("slurmd must run as root to start jobs: run the Slurm tests as root")


def slurm_conf(root: Path, nodes: tuple[str, ...], cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    ctld_port, *node_ports = free_ports(1 + len(nodes))
    lines = [
        "ClusterName=gptruntest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.sock'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
    ]
    for name, port in zip(nodes, node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=2000"
        )
    lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-1500:] if path.exists() else "(no log)"


@contextlib.contextmanager
def slurm_cluster(nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2) -> Iterator[Slurm]:
    """munged, slurmctld and one slurmd per node, in the foreground of processes this function
    started; all jobs cancelled and those processes stopped (by pid) at the end."""
    check_binaries()
    root = Path(tempfile.mkdtemp(prefix="gptrun-slurm-"))  # short: Unix socket paths
    root.chmod(0o755)  # munged wants every folder above its socket searchable by all
    munge = root / "munge"
    for folder in (munge, root / "state", root / "spool"):
        folder.mkdir(mode=0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, nodes, cpus))
    cluster = Slurm(root, nodes, cpus)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **cluster.env}
    daemons: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> None:
        with open(root / log, "ab") as out:
            daemons.append(
                subprocess.Popen(args, stdout=out, stderr=out, env=env, start_new_session=True, cwd=root)
            )

    try:
        start(
            ["munged", "-F", f"--socket={munge / 'munge.sock'}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
            "munged.out",
        )  # fmt: skip
        _wait_for(lambda: (munge / "munge.sock").exists(), 20, "munged", munge / "munged.log", daemons)
        start(["slurmctld", "-D", "-f", str(conf)], "slurmctld.out")
        for name in nodes:
            start(["slurmd", "-D", "-f", str(conf), "-N", name], f"slurmd-{name}.out")
        _wait_for(
            lambda: _idle(cluster) == set(nodes), 60, "the nodes to be idle", root / "slurmctld.log", daemons
        )
        yield cluster
    finally:
        if daemons[1:]:
            cluster.command("scancel", "--quiet", "--partition=test")
            with contextlib.suppress(RuntimeError):
                _wait_for(lambda: not _jobs(cluster), 60, "the jobs to end", root / "slurmctld.log", [])
        for proc in reversed(daemons):  # slurmd, slurmctld, then munged
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _idle(cluster: Slurm) -> set[str]:
    proc = cluster.command("sinfo", "-h", "-N", "-o", "%N %T")
    return {line.split()[0] for line in proc.stdout.splitlines() if line.split()[1:] == ["idle"]}


def _jobs(cluster: Slurm) -> list[str]:
    return cluster.command("squeue", "-h", "-o", "%i").stdout.split()


def _wait_for(ready, timeout: float, what: str, log: Path, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            reason = f"{', '.join(dead)} exited" if dead else f"no answer in {timeout:g}s"
            raise RuntimeError(f"Slurm did not start ({what}: {reason}); {log}:\n{_tail(log)}")
        time.sleep(0.2)
