"""The generated CRDs: structural, complete, and keeping every field of Dynamo's manifests."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

from dynamo_snapshot.api.checkpoint import (
    CHECKPOINT_NAME_MAX_LENGTH,
    CHECKPOINT_NAME_MESSAGE,
    IDENTITY_IMMUTABLE_MESSAGE,
    DynamoCheckpoint,
)
from dynamo_snapshot.api.container import (
    ENV_VALUE_AND_VALUE_FROM_MESSAGE,
    GPU_COUNT_MESSAGE,
)
from dynamo_snapshot.api.crdgen import build_crd, generated_crd, render_crds
from dynamo_snapshot.api.graphdeployment import (
    GRAPH_AND_SERVICE_MESSAGE,
    GRAPH_NAME_MESSAGE,
    MANUAL_NEEDS_REF_MESSAGE,
    SERVICE_NAME_LENGTH_MESSAGE,
    SERVICE_NAME_MESSAGE,
    SERVICE_NAME_PATTERN,
    DynamoGraphDeployment,
)
from dynamo_snapshot.api.kube import CustomResource, KubeModel
from dynamo_snapshot.api.resources import CUSTOM_RESOURCES
from dynamo_snapshot.api.structural import structural_problems, structural_schema

PRESERVE = "x-kubernetes-preserve-unknown-fields"
INT_OR_STRING = "x-kubernetes-int-or-string"
RULES = "x-kubernetes-validations"


def _schema(resource: type[CustomResource]) -> dict[str, Any]:
    schema: dict[str, Any] = build_crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every mapping in the document, however nested (validation rules and enums included)."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _nodes(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _nodes(value, f"{path}/{index}")


def _schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node: properties, map values and list items."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schema_nodes(node["additionalProperties"], f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")


def _at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in path.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return node


# --- a local model of what the apiserver does with a manifest -----------------------------------


def _prune(value: Any, schema: dict[str, Any]) -> Any:
    """Drop what the apiserver would drop: keys a schema neither declares nor preserves."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        additional = schema.get("additionalProperties")
        kept = {}
        for key, sub in value.items():
            if key in properties:
                kept[key] = _prune(sub, properties[key])
            elif isinstance(additional, dict):
                kept[key] = _prune(sub, additional)
            elif schema.get(PRESERVE):
                kept[key] = sub
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(item, schema["items"]) for item in value]
    return value


_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def _violations(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The OpenAPI checks the apiserver makes before CEL (types, enums, bounds, required keys)."""
    found: list[str] = []
    expected = schema.get("type")
    if expected and (
        not isinstance(value, _TYPES[expected]) or (expected == "integer" and isinstance(value, bool))
    ):
        return [f"{path}: {value!r} is not {expected}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        found.append(f"{path}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        found.append(f"{path}: {value} > {schema['maximum']}")
    if schema.get("x-kubernetes-int-or-string") and not isinstance(value, (int, str)):
        return [f"{path}: {value!r} is neither integer nor string"]
    # String checks apply to the strings of an int-or-string value only.
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            found.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            found.append(f"{path}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            found.append(f"{path}: does not match {schema['pattern']}")
    if isinstance(value, dict):
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            found.append(f"{path}: more than {schema['maxProperties']} entries")
        found += [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
        for key, sub in value.items():
            if key in schema.get("properties", {}):
                found += _violations(sub, schema["properties"][key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                found += _violations(sub, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += _violations(item, schema["items"], f"{path}[{index}]")
    return found


# --- structure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("resource", CUSTOM_RESOURCES, ids=lambda resource: resource.__name__)
def test_schema_is_structural(resource: type[CustomResource]) -> None:
    schema = _schema(resource)
    assert structural_problems(schema) == []
    for where, node in _nodes(schema):
        for keyword in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const"):
            assert keyword not in node, f"{where}: {keyword} left in the schema"
        assert node.get("additionalProperties") is not False, where
    for where, node in _schema_nodes(schema):
        assert "type" in node or node.get(PRESERVE) or node.get(INT_OR_STRING), (
            f"{where or '<root>'} has no type"
        )
        if "properties" in node or "additionalProperties" in node:
            assert node["type"] == "object", where
        assert not ("properties" in node and "additionalProperties" in node), where


@pytest.mark.parametrize("resource", CUSTOM_RESOURCES, ids=lambda resource: resource.__name__)
def test_crd_envelope(resource: type[CustomResource]) -> None:
    crd = build_crd(resource)
    info = resource.resource
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{info.plural}.nvidia.com"
    assert crd["spec"]["group"] == "nvidia.com"
    # The one cluster-scoped kind: a PodSnapshotContent outlives no namespace's say and is made by the
    # controller only, as in NVIDIA Snapshot.
    assert crd["spec"]["scope"] == ("Cluster" if info.kind == "PodSnapshotContent" else "Namespaced")
    [version] = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    assert schema["required"] == ["spec"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    assert PRESERVE not in schema


def test_names() -> None:
    names = {resource.__name__: build_crd(resource)["spec"]["names"] for resource in CUSTOM_RESOURCES}
    assert names["DynamoGraphDeployment"] == {
        "kind": "DynamoGraphDeployment",
        "listKind": "DynamoGraphDeploymentList",
        "plural": "dynamographdeployments",
        "singular": "dynamographdeployment",
        "shortNames": ["dgd"],
    }
    assert names["DynamoCheckpoint"]["plural"] == "dynamocheckpoints"
    assert names["DynamoCheckpoint"]["shortNames"] == ["dckpt"]


def test_checkpoint_printer_columns() -> None:
    columns = build_crd(DynamoCheckpoint)["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [(column["name"].upper(), column["jsonPath"]) for column in columns] == [
        ("MODEL", ".spec.identity.model"),
        ("BACKEND", ".spec.identity.backendFramework"),
        ("PHASE", ".status.phase"),
        ("HASH", ".status.identityHash"),
        ("AGE", ".metadata.creationTimestamp"),
    ]
    assert columns[-1]["type"] == "date"


def test_checkpoint_identity_rules() -> None:
    identity = _at(_schema(DynamoCheckpoint), "spec.identity")
    assert identity["x-kubernetes-validations"] == [
        {"rule": "self == oldSelf", "message": IDENTITY_IMMUTABLE_MESSAGE}
    ]
    assert "identity is immutable" in IDENTITY_IMMUTABLE_MESSAGE
    assert identity["required"] == ["backendFramework", "model"]
    assert PRESERVE not in identity
    assert identity["properties"]["backendFramework"]["enum"] == ["vllm", "sglang", "trtllm"]
    assert identity["properties"]["model"]["minLength"] == 1
    for key in ("tensorParallelSize", "pipelineParallelSize"):
        assert identity["properties"][key] | {"description": ""} == {
            "type": "integer",
            "default": 1,
            "minimum": 0,
            "maximum": 2**31 - 1,
            "description": "",
        }
    assert identity["properties"]["maxModelLen"]["minimum"] == 0
    assert identity["properties"]["extraParameters"]["additionalProperties"] == {"type": "string"}


def test_checkpoint_job_defaults() -> None:
    job = _at(_schema(DynamoCheckpoint), "spec.job")
    assert job["required"] == ["podTemplateSpec"]
    assert job["properties"]["podTemplateSpec"] | {"description": ""} == {
        "type": "object",
        PRESERVE: True,
        "description": "",
    }
    defaults = {
        key: job["properties"][key]["default"] for key in job["properties"] if key != "podTemplateSpec"
    }
    assert defaults == {"activeDeadlineSeconds": 3600, "backoffLimit": 3, "ttlSecondsAfterFinished": 300}


def test_checkpoint_status() -> None:
    status = _at(_schema(DynamoCheckpoint), "status")
    assert status["properties"]["phase"]["enum"] == ["Pending", "Creating", "Ready", "Failed"]
    for key in ("identityHash", "location", "storageType", "jobName", "createdAt", "message", "conditions"):
        assert key in status["properties"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert conditions["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]


def test_graph_deployment_service_rules() -> None:
    schema = _schema(DynamoGraphDeployment)
    checkpoint = _at(schema, "spec.services.*.checkpoint")
    assert [rule["message"] for rule in checkpoint["x-kubernetes-validations"]] == [MANUAL_NEEDS_REF_MESSAGE]
    assert checkpoint["properties"]["mode"]["enum"] == ["Auto", "Manual"]
    assert checkpoint["properties"]["mode"]["default"] == "Auto"
    assert checkpoint["properties"]["enabled"]["default"] is False
    assert checkpoint["properties"]["checkpointRef"]["maxLength"] == CHECKPOINT_NAME_MAX_LENGTH == 52
    identity = _at(schema, "spec.services.*.checkpoint.identity")
    assert identity == {
        key: value
        for key, value in _at(_schema(DynamoCheckpoint), "spec.identity").items()
        if key != "x-kubernetes-validations"
    } | {"description": identity["description"]}


def _messages(node: dict[str, Any]) -> list[str]:
    return [rule["message"] for rule in node.get(RULES, [])]


def test_names_are_checked_where_pods_and_jobs_get_them() -> None:
    graph = _schema(DynamoGraphDeployment)
    assert graph[RULES] == [
        {"rule": "self.metadata.name.size() <= 63", "message": GRAPH_NAME_MESSAGE, "fieldPath": ".metadata"},
        {
            "rule": "!has(self.spec.services) || "
            "self.spec.services.all(k, self.metadata.name.size() + k.size() <= 56)",
            "message": GRAPH_AND_SERVICE_MESSAGE,
            "fieldPath": ".spec.services",
        },
    ]
    services = _at(graph, "spec.services")
    assert services[RULES] == [
        {"rule": f"self.all(k, k.matches('{SERVICE_NAME_PATTERN}'))", "message": SERVICE_NAME_MESSAGE},
        {"rule": "self.all(k, k.size() <= 63)", "message": SERVICE_NAME_LENGTH_MESSAGE},
    ]
    assert services["maxProperties"] == 25
    assert _schema(DynamoCheckpoint)[RULES] == [
        {
            "rule": "self.metadata.name.size() <= 52",
            "message": CHECKPOINT_NAME_MESSAGE,
            "fieldPath": ".metadata",
        }
    ]


@pytest.mark.parametrize("path", ["spec.envs", "spec.services.*.envs"])
def test_env_entries_need_a_name(path: str) -> None:
    env = _at(_schema(DynamoGraphDeployment), path)["items"]
    assert env["required"] == ["name"]
    assert env["properties"]["name"]["minLength"] == 1
    assert env["properties"]["value"] == {"type": "string"}
    assert env[PRESERVE] is True
    assert _messages(env) == [ENV_VALUE_AND_VALUE_FROM_MESSAGE]
    assert _violations([{"value": "x"}], _at(_schema(DynamoGraphDeployment), path)) == ["[0].name: required"]


@pytest.mark.parametrize("kind", ["requests", "limits"])
def test_resource_items_check_their_quantities(kind: str) -> None:
    item = _at(_schema(DynamoGraphDeployment), f"spec.services.*.resources.{kind}")
    assert item[PRESERVE] is True
    properties = item["properties"]
    assert set(properties) == {"cpu", "memory", "gpu", "gpuType", "custom", "nvidia.com/gpu"}
    assert _messages(properties["gpu"]) == [GPU_COUNT_MESSAGE]
    assert properties["gpu"]["type"] == "string"
    gpu = properties["nvidia.com/gpu"]
    assert gpu[INT_OR_STRING] is True
    assert "type" not in gpu
    assert _messages(gpu) == [GPU_COUNT_MESSAGE]
    for name in ("cpu", "memory"):
        assert "quantity" in _messages(properties[name])[0]
    assert "quantity" in _messages(properties["custom"]["additionalProperties"])[0]
    assert properties["custom"]["maxProperties"] == 64
    assert len(_messages(properties["custom"])) == 2
    assert len(_messages(item)) == 2


@pytest.mark.parametrize(
    "path",
    [
        "spec",
        "spec.services.*",
        "spec.services.*.extraPodSpec",
        "spec.services.*.extraPodSpec.mainContainer",
        "spec.services.*.resources",
        "spec.services.*.livenessProbe",
        "spec.services.*.readinessProbe",
        "spec.services.*.checkpoint",
    ],
)
def test_graph_deployment_keeps_unknown_fields(path: str) -> None:
    assert _at(_schema(DynamoGraphDeployment), path)[PRESERVE] is True


def test_graph_deployment_status() -> None:
    status = _at(_schema(DynamoGraphDeployment), "status")
    for key in ("observedGeneration", "state", "conditions", "services", "checkpoints"):
        assert key in status["properties"]
    services = status["properties"]["services"]["additionalProperties"]["properties"]
    assert {"replicas", "readyReplicas", "restoredReplicas", "coldStartedReplicas"} <= set(services)
    checkpoints = status["properties"]["checkpoints"]["additionalProperties"]["properties"]
    assert set(checkpoints) == {"checkpointName", "identityHash", "ready"}


# --- the example manifests against the schema ----------------------------------------------------


def _resource_for(manifest: dict[str, Any]) -> type[CustomResource]:
    [resource] = [r for r in CUSTOM_RESOURCES if r.resource.kind == manifest["kind"]]
    return resource


def test_manifest_survives_pruning(manifest: dict[str, Any]) -> None:
    # metadata is the apiserver's own, never pruned by a CRD schema.
    body = {key: value for key, value in manifest.items() if key != "metadata"}
    assert _prune(body, _schema(_resource_for(manifest))) == body


def test_pruning_model_drops_what_no_schema_keeps() -> None:
    body = {"spec": {"identity": {"model": "m", "backendFramework": "vllm", "typo": 1}, "job": {"x": 1}}}
    pruned = _prune(body, _schema(DynamoCheckpoint))
    assert pruned == {"spec": {"identity": {"model": "m", "backendFramework": "vllm"}, "job": {"x": 1}}}


def test_manifest_passes_openapi_validation(manifest: dict[str, Any]) -> None:
    assert _violations(manifest, _schema(_resource_for(manifest))) == []


def test_openapi_checks_catch_bad_identities() -> None:
    schema = _schema(DynamoCheckpoint)
    bad = {
        "spec": {
            "identity": {"model": "", "backendFramework": "onnx", "tensorParallelSize": -1},
            "job": {"podTemplateSpec": {}},
        }
    }
    found = _violations(bad, schema)
    assert any(".spec.identity.backendFramework" in v for v in found)
    assert any(".spec.identity.tensorParallelSize" in v for v in found)
    assert any(".spec.identity.model" in v for v in found)


# --- the converter itself ------------------------------------------------------------------------


class _Leaf(KubeModel):
    count: int | None = None


class _Shapes(KubeModel):
    optional_leaf: _Leaf | None = None
    leaves: dict[str, _Leaf] = Field(default_factory=dict)
    free_form: dict[str, Any] | None = None
    tags: list[str] | None = None


class _Union(BaseModel):
    value: int | str


class _IntBounds(BaseModel):
    count: int = Field(default=1, gt=0, lt=10)


class _FloatBounds(BaseModel):
    ratio: float = Field(gt=0)


def test_converter_inlines_optional_models_and_maps() -> None:
    schema = structural_schema(_Shapes)
    properties = schema["properties"]
    assert properties["optionalLeaf"] == {
        "type": "object",
        "properties": {"count": {"type": "integer"}},
        PRESERVE: True,
    }
    assert properties["leaves"]["additionalProperties"]["properties"] == {"count": {"type": "integer"}}
    assert properties["freeForm"] == {"type": "object", PRESERVE: True}
    assert properties["tags"] == {"type": "array", "items": {"type": "string"}}
    assert structural_problems(schema) == []


def test_converter_refuses_unions() -> None:
    with pytest.raises(ValueError, match=r"_Union\.value: a union of 2 schemas"):
        structural_schema(_Union)


def test_converter_turns_exclusive_integer_bounds_inclusive() -> None:
    assert structural_schema(_IntBounds)["properties"]["count"] == {
        "type": "integer",
        "default": 1,
        "minimum": 1,
        "maximum": 9,
    }
    with pytest.raises(ValueError, match="exclusiveMinimum is only supported on integers"):
        structural_schema(_FloatBounds)


def test_bare_objects_are_flagged() -> None:
    problems = structural_problems({"type": "object", "properties": {"config": {"type": "object"}}})
    assert problems == ["<root>.config: object declares no fields and keeps none; everything would be pruned"]


def test_rendered_yaml_is_plain() -> None:
    for name, text in render_crds().items():
        assert not re.search(r"[&*]id\d", text), f"{name} uses YAML anchors"
        assert yaml.safe_load(text) == generated_crd(
            next(r for r in CUSTOM_RESOURCES if name == f"nvidia.com_{r.resource.plural}.yaml")
        )
