"""What the API tests, the apiserver integration tests and tests/examples share: the model of each kind,
a check that nothing was lost on the way through a model or the apiserver, and a DynamoScalingPolicy."""

from __future__ import annotations

from typing import Any

from dynamo_snapshot.api.kube import CustomResource
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION
from dynamo_snapshot.api.resources import CUSTOM_RESOURCES

# The pydantic model of each kind, by the manifest's `kind`.
MODELS: dict[str, type[CustomResource]] = {resource.resource.kind: resource for resource in CUSTOM_RESOURCES}

WAITING = 'sum(vllm:num_requests_waiting{namespace="ns"})'


def lost(given: Any, kept: Any, path: str = "") -> list[str]:
    """Everything in ``given`` that ``kept`` lacks or changed; additions (defaults) are fine."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [f"{path}: became {kept!r}"]
        return [gone for key, value in given.items() for gone in lost(value, kept.get(key), f"{path}.{key}")]
    if isinstance(given, list):
        if not isinstance(kept, list) or len(kept) != len(given):
            return [f"{path}: became {kept!r}"]
        return [gone for i, item in enumerate(given) for gone in lost(item, kept[i], f"{path}[{i}]")]
    return [] if given == kept else [f"{path}: {given!r} became {kept!r}"]


def scaling_policy(
    name: str = "llama-decode", *, namespace: str | None = None, **spec: Any
) -> dict[str, Any]:
    """A valid DynamoScalingPolicy manifest (two metrics: waiting and kv-cache); ``spec`` replaces keys of
    its spec. A new one each call: tests may change it in place."""
    body: dict[str, Any] = {
        "target": {"dgdName": "llama", "serviceName": "VllmDecodeWorker"},
        "maxReplicas": 8,
        "metrics": [
            {"name": "waiting", "query": WAITING, "targetPerReplica": 4},
            {"name": "kv-cache", "query": "avg(vllm:kv_cache_usage_perc)", "targetPerReplica": 0.75},
        ],
    }
    body.update(spec)
    metadata: dict[str, Any] = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoScalingPolicy",
        "metadata": metadata,
        "spec": body,
    }
