"""The recipes in cluster/, checked without a cloud account, a Kubernetes cluster or a Ray
process (fast): each `ray up` file against Ray's own config schema and its node types against the
cloud API that launches them (EC2 RunInstances through botocore, GCE instances.insert through
the Compute discovery document), the KubeRay manifests against the CRD schemas of the KubeRay
release they target (tests/schemas.py; strict about unknown fields), token auth and a dashboard
on 127.0.0.1 everywhere, shared storage at one path on every node, cloud credentials on every
worker, one Ray version everywhere, and the shell scripts' form. cluster/slurm.sh also runs for
real, under Slurm, in tests/test_slurm.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from tests.conftest import REPO, load_local_module
from tests.schemas import (
    ec2_run_instances_errors,
    errors,
    gce_instance_schema,
    kuberay_release,
    kuberay_schema,
)

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


def workers(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


def test_launcher_config_passes_rays_own_schema(launcher):
    """`ray.autoscaler._private.util.validate_config`: the JSON schema `ray up` checks (no cloud
    call, no credentials), plus head_node_type and max_workers >= sum of min_workers."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    name, cfg = launcher
    validate_config(cfg)
    broken = {k: v for k, v in cfg.items() if k != "provider"}
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        validate_config(broken)


def node_config_errors(provider: str, node_config: dict[str, Any]) -> list[str]:
    if provider == "aws":
        return ec2_run_instances_errors(node_config)
    return errors(node_config, gce_instance_schema())


def test_launcher_node_configs_pass_the_cloud_apis_schema(launcher):
    """Ray passes each node_config to the cloud's create-instance call as it is: every field
    must be one that API knows (a misspelled IamInstanceProfile or provisioningModel would
    fail only when the autoscaler first launches that node type)."""
    name, cfg = launcher
    provider = LAUNCHER[name]
    for key, node in cfg["available_node_types"].items():
        assert node_config_errors(provider, node["node_config"]) == [], key
    misspelled = {**node["node_config"], "InstanceMarketOption": {}, "serviceAcounts": []}
    found = "\n".join(node_config_errors(provider, misspelled))  # the check can fail
    assert "InstanceMarketOption" in found and "serviceAcounts" in found, found


def test_launcher_node_types(launcher):
    name, cfg = launcher
    assert isinstance(cfg["cluster_name"], str) and cfg["cluster_name"]
    assert cfg["provider"]["type"] == LAUNCHER[name]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert workers(cfg), "no worker node type"
    for key, node in workers(cfg).items():
        for field in ("min_workers", "max_workers", "resources", "node_config"):
            assert field in node, f"{name}: {key} lacks {field}"
        assert 0 <= node["min_workers"] <= node["max_workers"] <= cfg["max_workers"], key
    assert any(node["resources"].get("GPU", 0) >= 1 for node in types.values()), "no GPU type"
    # CPU configs get CPU workers, not GPU nodes they would leave idle.
    assert any(
        n["resources"].get("CPU", 0) >= 1 and not n["resources"].get("GPU") for n in workers(cfg).values()
    )
    # GPU trials never land on the driver's node: the head has no GPU resource.
    assert types[cfg["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_launcher_offers_spot_gpu_nodes(launcher):
    """A spot / preemptible GPU type, off by default (max_workers 0): trials resume from their
    checkpoints when a node is reclaimed."""
    name, cfg = launcher
    spot = {}
    for key, node in workers(cfg).items():
        conf = node["node_config"]
        if LAUNCHER[name] == "aws":
            is_spot = conf.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
        else:
            scheduling = conf.get("scheduling", {})
            is_spot = scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True
            if is_spot:  # GCE refuses a Spot VM that would restart by itself
                assert scheduling.get("automaticRestart") is False, (key, scheduling)
        if is_spot:
            spot[key] = node
    assert any(node["resources"].get("GPU", 0) >= 1 for node in spot.values()), list(workers(cfg))
    assert all(node["max_workers"] == 0 for node in spot.values()), "spot nodes are an option"


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


def test_launcher_workers_get_cloud_credentials(launcher):
    """Ray gives the head its own instance profile / service account and the workers none, so
    a trial on a worker could not reach s3:// or gs:// storage: each worker type names one."""
    name, cfg = launcher
    for key, node in workers(cfg).items():
        conf = node["node_config"]
        if LAUNCHER[name] == "aws":
            profile = conf.get("IamInstanceProfile", {})
            assert profile.get("Arn", "").startswith("arn:aws:iam::") or profile.get("Name"), key
        else:
            (account,) = conf.get("serviceAccounts", [{}])
            assert account.get("email", "").endswith(".iam.gserviceaccount.com"), key
            assert "https://www.googleapis.com/auth/cloud-platform" in account["scopes"], key


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


def export_command(text: str) -> str:
    """The shell command in a recipe's usage comment that exports the code for the nodes."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(
        i for i, line in enumerate(lines) if "git archive" in line or line.startswith("rm -rf build/")
    )
    command = []
    for line in lines[start:]:
        command.append(line.split("  #")[0].rstrip(" \\"))
        if not line.split("  #")[0].rstrip().endswith("\\"):
            return " ".join(command)
    raise AssertionError("unterminated command")


def test_launcher_ships_a_clean_export_of_the_code(launcher, tmp_path):
    """Not the working tree: `ray up` hashes everything a file mount holds, and a file that
    changes there (a checkpoint, the venv) re-runs setup and restarts Ray on the head. The code
    comes from the folder the usage comment's `git archive` fills, installed on every node."""
    name, cfg = launcher
    text = (CLUSTER / name).read_text()
    code = [(remote, local) for remote, local in cfg["file_mounts"].items() if "token" not in remote]
    assert len(code) == 1, cfg["file_mounts"]
    remote, local = code[0]
    assert Path(local).parts[0] not in (".", "..", "~") and not Path(local).is_absolute(), local
    command = export_command(text)
    assert f"-C {local}" in command, (command, local)
    subprocess.run(
        ["bash", "-c", command.replace(local, str(tmp_path / "src"))], cwd=REPO, check=True, timeout=120
    )
    exported = {p.relative_to(tmp_path / "src").parts[0] for p in (tmp_path / "src").iterdir()}
    assert {"pyproject.toml", "gptcore", "experiments"} <= exported, exported
    assert not exported & {".venv", "data", "runs", "sweeps", ".cluster", ".git"}, exported
    config = re.search(r"gptrun sweep (\S+\.toml)", text).group(1)  # the usage's config path
    assert home("~/" + config).startswith(home(remote) + "/"), (config, remote)
    assert (tmp_path / "src" / Path(config).relative_to(Path(home(remote)).name)).is_file(), config
    installs = [c for c in cfg["setup_commands"] if "pip install" in c]
    assert any(re.search(rf"\s{re.escape(remote)}$", c) for c in installs), (remote, installs)
    assert any("ray[" in c and "==" in c for c in installs), "Ray must be pinned on the nodes"


def test_launcher_apt_waits_for_the_package_lock(launcher):
    """A new Ubuntu VM runs unattended-upgrades at boot, holding apt's lock for minutes: every
    apt-get in the setup waits for it instead of failing the node."""
    name, cfg = launcher
    commands = [c for key in cfg if key.endswith("_commands") for c in cfg[key]]
    calls = [m for c in commands for m in re.finditer(r"apt-get((?:\s+-o\s+\S+)*)\s+(\w+)", c)]
    assert {m.group(2) for m in calls} >= {"update", "install"}, calls
    for call in calls:
        timeout = re.search(r"DPkg::Lock::Timeout=(\d+)", call.group(1))
        assert timeout and int(timeout.group(1)) >= 300, call.group(0)


def test_launcher_mounts_shared_storage_on_every_node(launcher):
    name, cfg = launcher
    mounts = [c for c in cfg["setup_commands"] if "mount -t nfs" in c]
    assert len(mounts) == 1, name
    assert "/mnt/shared" in mounts[0]
    assert "--storage /mnt/shared/" in (CLUSTER / name).read_text()  # the usage says where


def test_aws_says_efs_needs_a_mount_target_in_every_zone():
    """Nodes start in any of the provider's zones; EFS answers only in zones with a mount target."""
    text = (CLUSTER / "aws.yaml").read_text()
    zones = load(CLUSTER / "aws.yaml")["provider"]["availability_zone"].split(",")
    comments = "\n".join(line.partition("#")[2] for line in text.splitlines() if "#" in line)
    assert "create-mount-target" in comments
    for zone in zones:
        assert zone in comments, zone


# ------------------------------------------------------------------ KubeRay


def ray_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in load_all(path) if d["apiVersion"] == "ray.io/v1"]


@pytest.mark.parametrize("path", [KUBERAY / "raycluster.yaml", KUBERAY / "rayjob.yaml"], ids=lambda p: p.name)
def test_kuberay_manifests_pass_the_crd_schemas(path):
    """Checked against the CRDs' openAPIV3Schema of the KubeRay release the manifests name, made
    strict (tests/schemas.py): an unknown or misspelled field fails here, as `kubectl apply`
    (strict field validation) would fail it."""
    docs = ray_docs(path)
    assert docs
    for doc in docs:
        assert kuberay_release() in path.read_text()  # the release the comments say they target
        assert errors(doc, kuberay_schema(doc["kind"])) == []
        broken = yaml.safe_load(yaml.safe_dump(doc))
        spec = broken["spec"].get("rayClusterSpec", broken["spec"])
        spec["autoscalerOption"] = spec.pop("autoscalerOptions")
        spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resourses"] = {}
        found = errors(broken, kuberay_schema(doc["kind"]))
        assert len(found) == 2 and "autoscalerOption" in found[1] and "resourses" in found[0], found


def containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    spec = group["template"]["spec"]
    assert spec["containers"], group
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


def check_ray_cluster_spec(spec: dict[str, Any], account: str) -> tuple[str, str]:
    """The checks a RayCluster spec must pass; returns (claim name, mount path) of the shared
    volume, the same in the head and every worker group."""
    assert spec["authOptions"]["mode"] == "token"
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0  # idle GPU nodes go away
    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # never a public LoadBalancer
    assert "dashboard-host" not in head["rayStartParams"]  # KubeRay's 0.0.0.0, behind ClusterIP
    groups = [head, *spec["workerGroupSpecs"]]
    images = {c["image"] for group in groups for c in containers(group)}
    assert len(images) == 1, images  # a worker started later runs the head's Ray
    tag = images.pop().rsplit("/", 1)[-1].partition(":")[2]
    assert tag and tag != "latest", tag
    head_mounts = pvc_mounts(head)
    assert len(head_mounts) == 1, head_mounts
    for group in groups:
        pod = group["template"]["spec"]
        assert pod.get("serviceAccountName") == account  # the cloud credentials of every pod
        assert pvc_mounts(group) == head_mounts, (group.get("groupName"), pvc_mounts(group))
        # KubeRay mounts /dev/shm itself, sized to the container's memory: no volume of our own.
        mounts = [m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])]
        assert "/dev/shm" not in mounts, mounts
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"], group
        pod = group["template"]["spec"]
        for c in containers(group):
            gpus = c["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus is not None and int(gpus) >= 1, c["resources"]
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), pod
        assert pod.get("nodeSelector"), "GPU pods need a GPU node's label"
    return next(iter(head_mounts.items()))


def raycluster_objects() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in load_all(KUBERAY / "raycluster.yaml")}


def test_raycluster_has_token_auth_gpu_workers_one_rwx_volume_and_a_service_account():
    kinds = raycluster_objects()
    assert set(kinds) == {"PersistentVolumeClaim", "ServiceAccount", "RayCluster"}
    cluster, pvc, account = kinds["RayCluster"], kinds["PersistentVolumeClaim"], kinds["ServiceAccount"]
    claim, _ = check_ray_cluster_spec(cluster["spec"], account["metadata"]["name"])
    assert pvc["apiVersion"] == "v1" and pvc["metadata"]["name"] == claim
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pvc["spec"]["resources"]["requests"]["storage"]
    # IRSA (EKS) or Workload Identity (GKE): the pods' cloud identity, on an EDIT line.
    annotations = account["metadata"]["annotations"]
    assert set(annotations) & {"eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account"}, annotations
    text = (KUBERAY / "raycluster.yaml").read_text()
    for key, value in annotations.items():
        assert re.search(rf"^\s*{re.escape(key)}: {re.escape(value)}\s+# EDIT", text, re.M), key
    assert "iam.gke.io/gcp-service-account" in text  # the GKE line, for the other cloud


def test_raycluster_usage_reads_the_token_secret_kuberay_creates():
    """KubeRay keeps the token in a Secret named after the cluster, under `auth_token`."""
    name = raycluster_objects()["RayCluster"]["metadata"]["name"]
    text = (KUBERAY / "raycluster.yaml").read_text()
    assert f"kubectl get secret {name} -o jsonpath='{{.data.auth_token}}' | base64 -d" in text
    assert "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=" in text and "ray job submit" in text


def run_entrypoint(entrypoint: str, mount: str, tmp_path: Path) -> list[str]:
    """Run the RayJob's entrypoint with /bin/sh (as Ray's job supervisor does), the volume at
    `tmp_path` and a stand-in `gptrun` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gptrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$CALLS"\n')
    (bin_dir / "gptrun").chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls)}
    subprocess.run(
        ["/bin/sh", "-c", entrypoint.replace(mount, str(tmp_path))], env=env, check=True, timeout=30
    )
    return calls.read_text().splitlines()


def test_rayjob_sweeps_on_the_shared_volume_and_resumes_a_sweep_that_exists(tmp_path):
    """A retry (backoffLimit) or the same RayJob applied again continues the sweep."""
    job = load(KUBERAY / "rayjob.yaml")
    spec = job["spec"]
    account = raycluster_objects()["ServiceAccount"]["metadata"]["name"]
    claim, mount = check_ray_cluster_spec(spec["rayClusterSpec"], account)
    assert claim == raycluster_objects()["PersistentVolumeClaim"]["metadata"]["name"]
    assert spec.get("shutdownAfterJobFinishes") is True and spec["backoffLimit"] > 0

    args = run_entrypoint(spec["entrypoint"], mount, tmp_path)
    assert args[:2] == ["sweep", "/app/experiments/configs/minimind-26m.toml"], args
    assert args[args.index("--address") + 1] == "auto"
    storage = Path(args[args.index("--storage") + 1])
    assert storage.parent == tmp_path, storage  # on the volume
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert f"data.dir={tmp_path}/data/shakespeare" in sets, sets
    exp_dir = storage / args[args.index("--name") + 1]

    exp_dir.mkdir(parents=True)  # killed before Tune saved anything: start it over
    assert run_entrypoint(spec["entrypoint"], mount, tmp_path)[:2] == args[:2]
    assert "--restart" in run_entrypoint(spec["entrypoint"], mount, tmp_path)
    (exp_dir / "tuner.pkl").write_bytes(b"")  # Tune's state: resume
    assert run_entrypoint(spec["entrypoint"], mount, tmp_path) == [
        "resume",
        str(exp_dir),
        "--address",
        "auto",
    ]


def test_readme_says_where_each_recipe_binds_the_dashboard():
    """127.0.0.1 on local.sh, ray up and Slurm (checked above); KubeRay binds it to 0.0.0.0 in the
    head pod, behind the ClusterIP Service (it sets no dashboard-host of ours, checked above): the
    README must say so rather than claim 127.0.0.1 everywhere."""
    text = (CLUSTER / "README.md").read_text()
    bullet = re.search(r"^- \*\*The dashboard.*?(?=^- \*\*|^#)", text, re.M | re.S).group(0)
    assert "127.0.0.1" in bullet and "Kubernetes" in bullet, bullet
    assert "0.0.0.0" in bullet and "ClusterIP" in bullet, bullet


# ------------------------------------------------------------------ one Ray version


def pinned_ray_versions() -> dict[str, set[str]]:
    """Every Ray version the recipes and docs pin, by file: pip pins, Ray images, rayVersion,
    and the `-ray<version>` tag of gptrun's image."""
    patterns = [
        r"\bray(?:\[[\w,]+\])?==([\d.]+)",
        r"rayproject/ray:([\d.]+)",
        r"rayVersion:\s*\"?([\d.]+)",
        r"gptrun:[\w.-]*-ray([\d.]+\d)",
    ]
    files = [p for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".sh", ".md", ".py")]
    files += [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        versions = {v for pattern in patterns for v in re.findall(pattern, text)}
        if versions:
            found[str(path.relative_to(REPO))] = versions
    return found


def test_one_ray_version_in_pyproject_the_recipes_and_the_tests():
    """What the tests run is what every recipe installs, and pyproject allows only that minor
    release (and never a Ray without token authentication, < 2.52)."""
    tested = version("ray")  # the Ray these tests run
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = [Requirement(r).specifier for r in project["dependencies"] if Requirement(r).name == "ray"]
    major, minor = (int(x) for x in tested.split(".")[:2])
    assert spec.contains(tested), (str(spec), tested)
    for other in (f"{major}.{minor - 1}.0", f"{major}.{minor + 1}.0", "2.51.0", "3.0.0"):
        assert not spec.contains(other), (str(spec), other)
    pins = pinned_ray_versions()
    assert {"cluster/aws.yaml", "cluster/gcp.yaml", "cluster/kuberay/raycluster.yaml"} <= set(pins), pins
    assert {"cluster/kuberay/rayjob.yaml", "cluster/README.md"} <= set(pins), pins
    assert {v for versions in pins.values() for v in versions} == {tested}, pins


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


@pytest.mark.parametrize(
    "args, needle",
    [
        (["up", "--port", "99999"], "argument --port: '99999' is not a port (1-65535)"),
        (["up", "--port", "http"], "'http' is not a port"),
        (["up", "--autoscale", "0"], "argument --autoscale: '0' must be a whole number >= 1"),
        (["up", "--autoscale", "-1"], "'-1' must be a whole number >= 1"),
        (["up", "--autoscale", "abc"], "'abc' must be a whole number >= 1"),
        (["up", "--nodes", "-1"], "argument --nodes: '-1' must be a whole number >= 0"),
        (["up", "--head-cpus", "-1"], "argument --head-cpus: '-1' must be a whole number >= 0"),
        (["up", "--gpus-per-node", "1.5"], "'1.5' must be a whole number >= 0"),
        (["up", "--object-store-mb", "10"], "'10' must be a whole number >= 80"),
        (
            ["up", "--idle-timeout-s", "nan"],
            "argument --idle-timeout-s: 'nan' must be a number of seconds > 0",
        ),
        (["up", "--timeout", "inf"], "'inf' must be a number of seconds > 0"),
        (["up", "--timeout", "0"], "'0' must be a number of seconds > 0"),
        (["up", "--autoscale", "2", "--nodes", "1"], "--autoscale MAX adds the worker nodes itself"),
        (["down", "--grace", "-1"], "argument --grace: '-1' must be a number of seconds > 0"),
        (["start-node", "worker1", "--cpus", "0"], "argument --cpus: '0' must be a whole number >= 1"),
    ],
)
def test_local_sh_refuses_bad_input_in_one_line_before_anything_starts(tmp_path, capsys, args, needle):
    """Exit 2 and one line, nothing written: Ray would listen on 99999 mod 65536, and a count
    or time that `ray start` refuses (or a nan that passes `<= 0`) showed once the head ran."""
    local = load_local_module()
    try:
        status = local.main([*args, "--dir", str(tmp_path / "c")])
    except SystemExit as exit_:  # argparse's refusals
        status = exit_.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "c").exists()


def test_local_sh_refuses_a_port_in_use_before_writing_its_state(tmp_path, capsys):
    local = load_local_module()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert local.main(["up", "--dir", str(tmp_path / "c"), "--port", str(port)]) == 2
    line = f"cluster/local.sh up: error: port {port} is in use; pick another --port or leave it out"
    assert capsys.readouterr().err.strip() == line
    assert not (tmp_path / "c").exists()  # no token or state left for the next `up` to find


@pytest.mark.parametrize(
    "args, line",
    [
        (["up", "--port", "99999"], "cluster/local.sh up: error: argument --port: '99999' is not a port"),
        (["stop"], "cluster/local.sh: unknown command 'stop'; see cluster/local.sh --help"),
    ],
)
def test_local_sh_itself_says_bad_input_in_one_line(tmp_path, args, line):
    """Through the shell wrapper, as a user types it: one line, exit 2, no usage text."""
    proc = subprocess.run(
        [str(CLUSTER / "local.sh"), *args, "--dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPTRUN_PYTHON": sys.executable},
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith(line), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "c").exists()
