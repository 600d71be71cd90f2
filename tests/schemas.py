"""Offline schema checks for the recipes in cluster/: what the cloud APIs and KubeRay would make
of them, without a cloud account or a Kubernetes cluster.

- KubeRay: the RayCluster / RayJob `openAPIV3Schema` of the release the manifests target,
  vendored in tests/kuberay_crds.json (see tests/vendor_kuberay_crds.py).
- AWS: a `ray up` node type's `node_config` is the body of EC2 RunInstances (Ray adds the counts
  and tags); botocore checks it against EC2's own API model, as boto3 does before sending it.
- GCP: a node type's `node_config` is the body of GCE instances.insert (Ray adds the name and
  labels); checked against the `Instance` schema of the Compute v1 discovery document that
  google-api-python-client ships.

The JSON schemas are made strict about unknown fields: CRD schemas mostly leave
`additionalProperties` unset (the API server prunes unknown fields, and kubectl's strict field
validation rejects them), and so do discovery documents, so `strict` adds
`additionalProperties: false` to every object schema that lists its `properties` (unless it
preserves unknown fields on purpose): a misspelled field is an error, as it is for kubectl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

KUBERAY_CRDS = Path(__file__).with_name("kuberay_crds.json")


def strict(node: Any) -> Any:
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items()}
    if (
        isinstance(node.get("properties"), dict)
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def errors(instance: Any, schema: dict[str, Any]) -> list[str]:
    """Every violation, as 'path.to.field: message'; empty when the instance is valid."""
    validator = jsonschema.Draft7Validator(strict(schema))
    found = []
    for error in validator.iter_errors(instance):
        path = ".".join(str(p) for p in error.absolute_path) or "(top)"
        found.append(f"{path}: {error.message}")
    return sorted(found)


def kuberay_schema(kind: str) -> dict[str, Any]:
    """The v1 `openAPIV3Schema` of KubeRay's `kind` CRD (RayCluster, RayJob)."""
    document = json.loads(KUBERAY_CRDS.read_text())
    return {**document[kind], "$defs": document["$defs"]}


def kuberay_release() -> str:
    return json.loads(KUBERAY_CRDS.read_text())["source"].split()[1]


def gce_instance_schema() -> dict[str, Any]:
    """GCE's `Instance` from the Compute v1 discovery document, as a JSON schema: the discovery
    format's bare `$ref: Name` made JSON pointers, and int64 fields (strings on the wire, numbers
    in client code and YAML) accepting both."""
    import googleapiclient

    path = Path(googleapiclient.__file__).parent / "discovery_cache/documents/compute.v1.json"
    schemas = json.loads(path.read_text())["schemas"]

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: convert(value) for key, value in node.items() if key != "required"}
        if isinstance(node.get("$ref"), str):
            out["$ref"] = f"#/definitions/{node['$ref']}"
        if node.get("type") == "string" and node.get("format") in ("int64", "uint64"):
            out["type"] = ["string", "integer"]
        return out

    return {"$ref": "#/definitions/Instance", "definitions": convert(schemas)}


def ec2_run_instances_errors(node_config: dict[str, Any]) -> list[str]:
    """What botocore says of RunInstances with this node_config (and one instance)."""
    from botocore.session import get_session
    from botocore.validate import ParamValidator

    shape = get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    report = ParamValidator().validate({**node_config, "MinCount": 1, "MaxCount": 1}, shape)
    return [line for line in report.generate_report().splitlines() if line.strip()]
