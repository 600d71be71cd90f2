"""Autoscaling clusters: what Ray's autoscaler can add, asking it for the nodes a sweep needs, and
waiting for them with one line per change.

The recipes start with no GPU worker (`min_workers: 0`, `replicas: 0`): checking the nodes alive
now would refuse every first sweep. On a cluster with an autoscaler, "can a trial ever fit" is
judged against the node types it can add and their max counts, the sweep's width against what
the cluster can grow to, and the nodes are asked for with `request_resources`:

- `request_resources(bundles=...)` rather than waiting for pending placement groups: it asks for
  the whole width at once (a DDP trial's worker bundles included, which only appear once its
  Tune process has started), bypasses the autoscaler's upscaling-speed limit, and is released
  explicitly at the end (`request_resources(bundles=[])`), after which idle nodes go away after
  the cluster's idle timeout. It is a floor on capacity, not a reservation: the trials still
  reserve their own resources through Tune and Ray Train.
- The wait for the first trial's nodes is bounded by GPTRUN_AUTOSCALE_WAIT_S (default 600 s:
  cloud nodes take minutes to boot); the rest of the width joins while the sweep runs.

Static clusters keep their checks in `experiments.cluster` (wait GPTRUN_RESOURCE_WAIT_S for the
resources, then one line).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from experiments.cluster import autoscale_wait_s, cluster_size, require_resources
from experiments.private_ray import (
    autoscaler_report,
    autoscaler_v2_on,
    head_resource,
    monitor_autoscaling_config,
    reported_cluster_config,
)
from gptcore.errors import UserError

Bundle = dict[str, float]  # {"CPU": c, "GPU": g}, as Ray's resource requests spell them
UNBOUNDED_NODES = 1024  # what a node type without max count (-1) stands for in the packing


@dataclass(frozen=True)
class NodeType:
    """A kind of node the autoscaler can add: its resources and how many it may run at most."""

    name: str
    cpus: float
    gpus: float
    max_count: int  # -1: no limit

    def describe(self) -> str:
        return f"{self.name}: {self.cpus:g} CPU, {self.gpus:g} GPU"


@dataclass(frozen=True)
class Growth:
    """What an autoscaling cluster can hold: the head's resources and the node types it adds."""

    head: tuple[float, float]
    node_types: tuple[NodeType, ...]
    known: bool = True  # False: an autoscaler runs, but its node types could not be read

    def pack(self, trial: list[Bundle], limit: int) -> tuple[int, dict[str, int]]:
        """Place up to `limit` trials (each its bundles) first-fit on the head and then on as
        many nodes of each type as the autoscaler may run: (trials placed, nodes used by type).
        Ray spreads the bundles of a trial over nodes the same way (PACK is soft)."""
        free = [[*self.head, "head"]]
        for kind in self.node_types:
            count = kind.max_count if kind.max_count >= 0 else UNBOUNDED_NODES
            free += [[kind.cpus, kind.gpus, kind.name] for _ in range(min(count, UNBOUNDED_NODES))]
        used: dict[int, str] = {}
        placed = 0
        while placed < limit:
            trial_free = [list(node) for node in free]
            slots = []
            for bundle in trial:
                slot = next(
                    (
                        i
                        for i, (cpus, gpus, _) in enumerate(trial_free)
                        if cpus + 1e-9 >= bundle.get("CPU", 0) and gpus + 1e-9 >= bundle.get("GPU", 0)
                    ),
                    None,
                )
                if slot is None:
                    break
                trial_free[slot][0] -= bundle.get("CPU", 0)
                trial_free[slot][1] -= bundle.get("GPU", 0)
                slots.append(slot)
            else:
                free = trial_free
                used.update({i: free[i][2] for i in slots if i > 0})
                placed += 1
                continue
            break
        nodes: dict[str, int] = {}
        for name in used.values():
            nodes[name] = nodes.get(name, 0) + 1
        return placed, nodes

    def maximum(self) -> tuple[float, float] | None:
        """The CPUs and GPUs of the largest cluster (None when a node type has no max count)."""
        if any(kind.max_count < 0 for kind in self.node_types):
            return None
        cpus = self.head[0] + sum(k.cpus * k.max_count for k in self.node_types)
        gpus = self.head[1] + sum(k.gpus * k.max_count for k in self.node_types)
        return cpus, gpus

    def describe(self) -> str:
        kinds = ", ".join(
            f"{k.describe()}, up to {k.max_count if k.max_count >= 0 else 'any number'}"
            for k in self.node_types
        )
        most = self.maximum()
        top = f"{most[0]:g} CPUs and {most[1]:g} GPUs at most" if most else "no maximum"
        return f"{top} ({kinds}; head {self.head[0]:g} CPU, {self.head[1]:g} GPU)"


def autoscaler_growth() -> Growth | None:
    """The node types the cluster's autoscaler can add, or None on a static cluster (no
    autoscaler reports to the head). Needs a Ray session.

    Where the limits come from, in Ray 2.60:
    1. the cluster config in the GCS's autoscaler state (`ray._private.state.state.
       get_cluster_config()`: node group resources and max counts), the source Ray Data uses to
       decide whether a cluster autoscales; autoscalers that report it fill it in;
    2. else the autoscaling config the head's autoscaler runs with (the `--autoscaling-config`
       file of its monitor process: `ray up`'s bootstrap config, `ray start --autoscaling-config`),
       read by a zero-CPU task on the head. Ray 2.60's own autoscalers (v1 and v2) do not report
       (1), and no public API returns the node types' max counts.
    An autoscaler is known to run when its status in the GCS (what `ray status` reads) names a
    node type of a cluster config (every `ray start --head` runs Ray's monitor, but on a static
    cluster with a read-only provider whose node types are the nodes themselves, `node_<id>`),
    or when Ray's autoscaler v2 is on (KubeRay's default). Its limits unknown, nothing is
    refused up front: the sweep asks for `sweep.max_concurrent` trials and the bounded wait says
    what did not come."""
    import ray

    config = reported_cluster_config()
    if config is not None and config.node_group_configs:
        kinds = tuple(
            NodeType(g.name, float(g.resources.get("CPU", 0)), float(g.resources.get("GPU", 0)), g.max_count)
            for g in config.node_group_configs
        )
        return Growth(_head_resources(), kinds)
    if not _autoscaler_runs():
        return None
    port = ray.get_runtime_context().gcs_address.rpartition(":")[2]
    reader = ray.remote(num_cpus=0, resources={head_resource(): 0.001}, max_retries=0)(_monitor_config)
    try:
        raw = ray.get(reader.remote(port), timeout=60)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
        raw = None
    if raw is None:
        return Growth(_head_resources(), (), known=False)
    return growth_from_config(json.loads(raw))


def _autoscaler_runs() -> bool:
    """Whether an autoscaler that can add nodes serves this cluster: the v1 monitor's status in
    the GCS's KV store (the key `ray status` reads) names a configured node type, not only the
    read-only provider's `node_<id>` mirrors of the nodes there; or autoscaler v2 is on."""
    report = autoscaler_report()
    if report is None:
        return autoscaler_v2_on()
    kinds = {*(report.get("node_type_mapping") or {}).values(), *(report.get("active_nodes") or {})}
    return any(not kind.startswith("node_") for kind in kinds)


def growth_from_config(config: dict) -> Growth:
    """A `Growth` from an autoscaling config (the `ray up` YAML's `available_node_types`)."""
    head_type = config.get("head_node_type")
    kinds, head = [], (0.0, 0.0)
    cluster_max = int(config.get("max_workers", -1))
    for name, spec in config.get("available_node_types", {}).items():
        res = spec.get("resources", {})
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        if name == head_type:
            head = (cpus, gpus)
            continue
        count = int(spec.get("max_workers", cluster_max))
        if cluster_max >= 0:
            count = min(count, cluster_max) if count >= 0 else cluster_max
        kinds.append(NodeType(name, cpus, gpus, count))
    return Growth(head, tuple(kinds))


def _head_resources() -> tuple[float, float]:
    import ray

    for node in ray.nodes():
        res = node.get("Resources", {})
        if node.get("Alive") and head_resource() in res:
            return float(res.get("CPU", 0)), float(res.get("GPU", 0))
    return 0.0, 0.0


def _monitor_config(gcs_port: str) -> str | None:
    """On the head: the autoscaling config of the autoscaler that serves the GCS on `gcs_port`
    (its monitor process's `--autoscaling-config=PATH`), as JSON; None if none is found."""
    import os
    from pathlib import Path

    import yaml

    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            args = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        config = monitor_autoscaling_config(args, gcs_port)
        if config:  # a relative path is the monitor's: from its working folder
            path = Path(entry.path, "cwd", os.path.expanduser(config))
            try:
                return json.dumps(yaml.safe_load(path.read_text()))
            except (OSError, yaml.YAMLError):
                return None
    return None


def plan_width(growth: Growth, trial: list[Bundle], cap: int, what: str) -> tuple[int, dict[str, int]]:
    """How many trials the grown cluster holds at once (at most `cap`) and the nodes that takes;
    one line when not even one trial fits any node type the autoscaler has."""
    width, nodes = growth.pack(trial, cap)
    if width == 0:
        need = _bundles_text(trial)
        kinds = "; ".join(k.describe() + f" (max {k.max_count})" for k in growth.node_types) or "none found"
        raise UserError(
            f"{what} needs {need}, which no node type of the autoscaler can hold (node types: {kinds}; "
            f"head {growth.head[0]:g} CPU, {growth.head[1]:g} GPU); lower --workers / resources or add "
            "a node type that fits"
        )
    return width, nodes


def _bundles_text(trial: list[Bundle]) -> str:
    shapes: dict[str, int] = {}
    for bundle in trial:
        key = f"{bundle.get('CPU', 0):g} CPU + {bundle.get('GPU', 0):g} GPU"
        shapes[key] = shapes.get(key, 0) + 1
    return " and ".join(f"{n} x ({shape})" for shape, n in shapes.items())


@contextlib.contextmanager
def nodes_requested(bundles: list[Bundle]) -> Iterator[None]:
    """Ask the autoscaler for room for `bundles` for the duration of the block, then release
    the request so that idle nodes scale back down."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a lost head: nothing left to release
            request_resources(bundles=[])


def wait_for_first_trial(trial: list[Bundle], nodes: dict[str, int], what: str) -> None:
    """Wait until the cluster could hold `trial`, one line each time the number of nodes that
    came up changes; bounded by GPTRUN_AUTOSCALE_WAIT_S, then one line naming the node type."""
    import ray

    wait_s = autoscale_wait_s()
    need_cpus = sum(b.get("CPU", 0) for b in trial)
    need_gpus = sum(b.get("GPU", 0) for b in trial)
    kinds = ", ".join(f"{n} x {name}" for name, n in nodes.items()) or "node types unknown"
    wanted = sum(nodes.values())
    start = time.monotonic()
    alive0 = _alive_workers()
    seen = None
    while True:
        total = ray.cluster_resources()
        up = max(0, _alive_workers() - alive0)
        if total.get("CPU", 0) + 1e-9 >= need_cpus and total.get("GPU", 0) + 1e-9 >= need_gpus:
            if seen is not None:
                print(
                    f"{what}: {up}/{wanted} node(s) up after {time.monotonic() - start:.0f} s; starting",
                    flush=True,
                )
            return
        if up != seen:
            count = f"{up}/{wanted}" if wanted else str(up)
            print(
                f"waiting for {wanted or 'the'} node(s) from the autoscaler ({kinds}): {count} up, "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
            seen = up
        if time.monotonic() - start > wait_s:
            raise UserError(
                f"the autoscaler brought up {up} of {wanted} node(s) ({kinds}) within {wait_s:g} s "
                f"(GPTRUN_AUTOSCALE_WAIT_S), too few for {what}; see `ray status` on the head for "
                "why (quota, capacity, failed launches), or raise the wait"
            )
        time.sleep(1.0)


def _alive_workers() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive") and head_resource() not in n.get("Resources", {}))


@contextlib.contextmanager
def room_for(
    trial: list[Bundle], cap: int, what: str, static_width: Callable[[float, float], int] | None
) -> Iterator[int]:
    """Inside a Ray session, the number of trials to run at once, for the duration of the block.

    A static cluster: `static_width(CPUs, GPUs)` of the nodes there once they fit `trial`
    (waiting GPTRUN_RESOURCE_WAIT_S, as before autoscaling existed); None skips the check (a
    resumed sweep keeps its saved width). An autoscaling cluster: as many trials as the grown
    cluster holds (at most `cap`), asked for from the autoscaler for the whole block, after a
    wait until the first one fits."""
    growth = autoscaler_growth()
    if growth is None:
        width = 0
        if static_width is not None:
            require_resources(sum(b.get("CPU", 0) for b in trial), sum(b.get("GPU", 0) for b in trial), what)
            width = static_width(*cluster_size())
        yield width
        return
    if growth.known:
        width, nodes = plan_width(growth, trial, cap, what)
        print(f"autoscaling cluster: {growth.describe()}; {width} trial(s) at a time", flush=True)
    else:
        width, nodes = cap, {}
        print(
            "autoscaling cluster (its node types could not be read here): asking for "
            f"{cap} trial(s) at a time",
            flush=True,
        )
    with nodes_requested([dict(b) for _ in range(width) for b in trial]):
        wait_for_first_trial(trial, nodes, what)
        yield width
