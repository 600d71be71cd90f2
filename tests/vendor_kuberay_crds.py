"""Write tests/kuberay_crds.json: the `openAPIV3Schema` of KubeRay's RayCluster and RayJob CRDs
(API version v1) of one release, which tests/test_cluster_files.py validates the manifests in
cluster/kuberay/ against.

    git clone --branch v1.7.0 --depth 1 https://github.com/ray-project/kuberay ../kuberay
    python tests/vendor_kuberay_crds.py v1.7.0 ../kuberay/ray-operator/config/crd/bases

The schemas are kept as they are, except that a subtree repeated verbatim (the pod template
of the head, of every worker group and of the RayJob submitter; the RayJob's rayClusterSpec,
which is the RayCluster's spec) is stored once under `$defs` and referred to by `$ref`: the same
schema, in 56 KB instead of 370 KB.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
OUT = Path(__file__).with_name("kuberay_crds.json")
MIN_SIZE = 1000  # characters of JSON: smaller repeats are not worth a $ref


def v1_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def canonical(node: Any) -> str:
    return json.dumps(node, sort_keys=True, separators=(",", ":"))


def subtrees(node: Any, found: Counter) -> None:
    if isinstance(node, dict):
        if "$ref" not in node:
            text = canonical(node)
            if len(text) >= MIN_SIZE:
                found[text] += 1
        for value in node.values():
            subtrees(value, found)
    elif isinstance(node, list):
        for value in node:
            subtrees(value, found)


def replace(node: Any, text: str, ref: dict[str, str]) -> Any:
    if isinstance(node, dict):
        if canonical(node) == text:
            return dict(ref)
        return {key: replace(value, text, ref) for key, value in node.items()}
    if isinstance(node, list):
        return [replace(value, text, ref) for value in node]
    return node


def deduplicate(schemas: dict[str, Any]) -> dict[str, Any]:
    """Hoist the largest repeated subtree into $defs until none repeats."""
    defs: dict[str, Any] = {}
    while True:
        found: Counter = Counter()
        subtrees([schemas, defs], found)
        repeated = [text for text, count in found.items() if count > 1]
        if not repeated:
            return {"$defs": defs, **schemas}
        text = max(repeated, key=len)
        name = f"shared{len(defs)}"
        schemas = replace(schemas, text, {"$ref": f"#/$defs/{name}"})
        defs = replace(defs, text, {"$ref": f"#/$defs/{name}"})
        defs[name] = json.loads(text)


def main(release: str, folder: str) -> None:
    schemas = {kind: v1_schema(Path(folder) / name) for kind, name in KINDS.items()}
    document = {"source": f"github.com/ray-project/kuberay {release} ray-operator/config/crd/bases"}
    document.update(deduplicate(schemas))
    OUT.write_text(json.dumps(document, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes, {len(document['$defs'])} shared subtrees)")


if __name__ == "__main__":
    main(*sys.argv[1:])
