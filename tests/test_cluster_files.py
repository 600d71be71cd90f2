"""The recipes in cluster/ (fast, no Ray process): every YAML parses and has what Ray's cluster
launcher and KubeRay need (Ray's own schema for the launcher files), token auth and a dashboard
on 127.0.0.1 everywhere, shared storage mounted at one path in every node; the shell scripts
parse, and cluster/slurm.sh runs end to end against stand-ins for srun, ray and gptrun."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

CLUSTER = REPO / "cluster"
LAUNCHER = {"aws.yaml": "aws", "gcp.yaml": "gcp"}
KUBERAY = CLUSTER / "kuberay"


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def load_all(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), path
    return docs


def home(path: str) -> str:
    """`~/x` and `$HOME/x` are the same file on a node."""
    return re.sub(r"^(\$HOME|\$\{HOME\}|~)/", "~/", path)


def test_every_yaml_under_cluster_parses():
    found = sorted(CLUSTER.rglob("*.yaml")) + sorted(CLUSTER.rglob("*.yml"))
    assert {p.name for p in found} >= {"aws.yaml", "gcp.yaml", "raycluster.yaml", "rayjob.yaml"}
    for path in found:
        load_all(path)


# ------------------------------------------------------------------ `ray up` (aws, gcp)


@pytest.fixture(params=sorted(LAUNCHER))
def launcher(request) -> tuple[str, dict[str, Any]]:
    return request.param, load(CLUSTER / request.param)


def test_launcher_config_passes_rays_own_schema(launcher):
    """`ray.autoscaler._private.util.validate_config`: the JSON schema `ray up` checks (no cloud
    call, no credentials), plus head_node_type and max_workers >= sum of min_workers."""
    jsonschema = pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import validate_config

    name, cfg = launcher
    validate_config(cfg)
    broken = {k: v for k, v in cfg.items() if k != "provider"}
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        validate_config(broken)


def test_launcher_node_types(launcher):
    name, cfg = launcher
    assert isinstance(cfg["cluster_name"], str) and cfg["cluster_name"]
    assert cfg["provider"]["type"] == LAUNCHER[name]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert workers, "no worker node type"
    for key, node in workers.items():
        for field in ("min_workers", "max_workers", "resources", "node_config"):
            assert field in node, f"{name}: {key} lacks {field}"
        assert 0 <= node["min_workers"] <= node["max_workers"] <= cfg["max_workers"], key
        assert node["node_config"], key
    assert any(node["resources"].get("GPU", 0) >= 1 for node in types.values()), "no GPU type"
    # GPU trials never land on the driver's node: the head has no GPU resource.
    assert types[cfg["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_gcp_gpu_types_declare_what_they_get():
    """GCP fills in no resources (AWS reads them from the instance type): each type's CPU/GPU
    must match its machine, and a GPU VM needs `scheduling` as an object (the GCE API field)
    with onHostMaintenance TERMINATE, or instances.insert refuses it."""
    cfg = load(CLUSTER / "gcp.yaml")
    for key, node in cfg["available_node_types"].items():
        conf, res = node["node_config"], node["resources"]
        assert res.get("CPU", 0) >= 1, key
        vcpus = int(conf["machineType"].rsplit("-", 1)[1])
        assert res["CPU"] <= vcpus, (key, conf["machineType"])
        gpus = sum(a["acceleratorCount"] for a in conf.get("guestAccelerators", []))
        assert res.get("GPU", 0) == gpus, (key, res, gpus)
        if gpus:
            assert isinstance(conf.get("scheduling"), dict), (key, conf.get("scheduling"))
            assert conf["scheduling"]["onHostMaintenance"] == "TERMINATE", key


def token_path(command: str) -> str:
    match = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+?);?(\s|$)", command)
    assert match, command
    return home(match.group(1).strip("'\""))


def test_launcher_ray_start_uses_the_token_and_a_local_dashboard(launcher):
    name, cfg = launcher
    paths = set()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert len(starts) == 1, (name, key)
        cmd = starts[0]
        # Each command runs in its own shell: the export must be in the one that starts Ray.
        assert cmd.index("export RAY_AUTH_MODE=token") < cmd.index("ray start"), (name, cmd)
        assert "RAY_AUTH_TOKEN=" not in cmd  # the file, never the token in a command line
        paths.add(token_path(cmd))
        assert "0.0.0.0" not in cmd, (name, cmd)
    head = next(c for c in cfg["head_start_ray_commands"] if "ray start" in c)
    assert re.search(r"--dashboard-host[= ]127\.0\.0\.1\b", head), head
    assert len(paths) == 1, paths  # head and workers read the same file
    # The token reaches every node through file_mounts and is made 0600 there.
    mounts = {home(remote): local for remote, local in cfg["file_mounts"].items()}
    token = paths.pop()
    assert token in mounts, (token, list(mounts))
    assert any(
        c.strip() == f"chmod 600 {token}" or c.strip() == f"chmod 600 {token.replace('~', '$HOME')}"
        for c in cfg["setup_commands"]
    ), cfg["setup_commands"]
    # The shells users get (ray attach, job entrypoints) have the same token settings.
    assert any("RAY_AUTH_MODE=token" in c and "RAY_AUTH_TOKEN_PATH" in c for c in cfg["setup_commands"])


def test_launcher_installs_gptrun_from_the_synced_repository(launcher):
    name, cfg = launcher
    repo = [home(remote) for remote, local in cfg["file_mounts"].items() if local in (".", "./")]
    assert len(repo) == 1, cfg["file_mounts"]
    installs = [c for c in cfg["setup_commands"] if "pip install" in c]
    assert any(repo[0] in shlex.split(c) for c in installs), (repo, installs)
    assert any("ray[" in c and "==" in c for c in installs), "Ray must be pinned on the nodes"
    # A local cluster's token (.cluster/token), the venv and data never travel with the code.
    assert {".cluster", ".venv", ".git"} <= set(cfg["rsync_exclude"])


def test_launcher_mounts_shared_storage_on_every_node(launcher):
    name, cfg = launcher
    mounts = [c for c in cfg["setup_commands"] if "mount -t nfs" in c]
    assert len(mounts) == 1, name
    assert "/mnt/shared" in mounts[0]
    assert "--storage /mnt/shared/" in (CLUSTER / name).read_text()  # the usage says where


# ------------------------------------------------------------------ KubeRay


def containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_template["template"]["spec"]
    assert spec["containers"], pod_template
    for c in spec["containers"]:
        assert c.get("image"), c
    return spec["containers"]


def pvc_mounts(group: dict[str, Any]) -> dict[str, str]:
    """claimName -> mountPath for every PVC volume mounted in the group's Ray container."""
    spec = group["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    ray_container = spec["containers"][0]
    return {
        claims[m["name"]]: m["mountPath"]
        for m in ray_container.get("volumeMounts", [])
        if m["name"] in claims
    }


def check_ray_cluster_spec(spec: dict[str, Any]) -> tuple[str, str]:
    """The checks a RayCluster spec must pass; returns (claim name, mount path) of the shared
    volume, the same in the head and every worker group."""
    assert spec["authOptions"]["mode"] == "token"
    major, minor = (int(x) for x in str(spec["rayVersion"]).split(".")[:2])
    assert (major, minor) >= (2, 52), "token auth needs Ray >= 2.52"
    head = spec["headGroupSpec"]
    containers(head)
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # never a public LoadBalancer
    head_mounts = pvc_mounts(head)
    assert len(head_mounts) == 1, head_mounts
    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"], group
        for c in containers(group):
            gpus = c["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus is not None and int(gpus) >= 1, c["resources"]
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations), tolerations
        assert pvc_mounts(group) == head_mounts, (group["groupName"], pvc_mounts(group))
    return next(iter(head_mounts.items()))


def test_raycluster_has_token_auth_gpu_workers_and_one_rwx_volume():
    docs = load_all(KUBERAY / "raycluster.yaml")
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "RayCluster"}
    cluster = kinds["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    claim, _ = check_ray_cluster_spec(cluster["spec"])
    pvc = kinds["PersistentVolumeClaim"]
    assert pvc["apiVersion"] == "v1" and pvc["metadata"]["name"] == claim
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_rayjob_runs_a_sweep_on_the_shared_volume():
    job = load(KUBERAY / "rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    claim, mount = check_ray_cluster_spec(spec["rayClusterSpec"])
    pvc = next(d for d in load_all(KUBERAY / "raycluster.yaml") if d["kind"] == "PersistentVolumeClaim")
    assert claim == pvc["metadata"]["name"]  # the volume the RayCluster file creates
    args = shlex.split(spec["entrypoint"])
    assert args[:2] == ["gptrun", "sweep"], args
    storage = args[args.index("--storage") + 1]
    assert storage.startswith(mount.rstrip("/") + "/"), (storage, mount)
    assert args[args.index("--address") + 1] == "auto"
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    data = [s.split("=", 1)[1] for s in sets if s.startswith("data.dir=")]
    assert data and data[0].startswith(mount.rstrip("/") + "/"), sets
    assert spec.get("shutdownAfterJobFinishes") is True


# ------------------------------------------------------------------ shell scripts


@pytest.mark.parametrize("script", ["local.sh", "slurm.sh"])
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(CLUSTER / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_local_sh_help_needs_no_ray():
    proc = subprocess.run([str(CLUSTER / "local.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for command in ("up", "status", "down", "kill-node", "env"):
        assert f"cluster/local.sh {command}" in proc.stderr, proc.stderr


def test_slurm_sh_directives():
    text = (CLUSTER / "slurm.sh").read_text()
    lines = text.splitlines()
    first_command = next(
        i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")
    )
    directives = [(i, line) for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    options = {line.split()[1].split("=")[0] for _, line in directives}
    assert {"--nodes", "--gpus-per-node", "--cpus-per-task", "--time", "--exclusive"} <= options
    for i, line in directives:
        assert i < first_command, f"sbatch ignores {line!r} after the first command"
        assert len(line.split()) == 2, f"{line!r}: one option per line, no trailing comment"
    assert "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=" in text
    assert "--dashboard-host 127.0.0.1" in text and "0.0.0.0" not in text


def test_slurm_sh_expands_arrays_that_may_be_empty_the_bash_4_2_way():
    """Bash before 4.4 (RHEL/CentOS 7 ship 4.2) stops a `set -u` script at "${a[@]}" of an empty
    array. No bash 4.2 can be installed here to run the script, so this reads it: every array that
    may be empty (made empty, or filled by `read -a` from a variable) is expanded only as
    ${a[@]+"${a[@]}"}, which is empty on every bash."""
    text = (CLUSTER / "slurm.sh").read_text()
    assert "set -euo pipefail" in text
    arrays = set(re.findall(r"^\s*(\w+)=\(\)", text, re.M)) | set(re.findall(r"read -r -a (\w+)", text))
    assert {"gpu_args", "worker_pids", "sweep_args", "head_args", "worker_args"} <= arrays, arrays
    for name in arrays:
        guarded = text.count(f'${{{name}[@]+"${{{name}[@]}}"}}')
        bare = text.count(f'"${{{name}[@]}}"')
        assert bare == guarded > 0, f"{name}: {bare - guarded} unguarded expansion(s)"
