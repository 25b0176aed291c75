"""Pure parts of the REST client: paths, error mapping, conflict retry, and failure without an apiserver."""

from __future__ import annotations

import asyncio
import socket

import pytest
from kubernetes_asyncio import client
from prometheus_client import REGISTRY

from dynamo_snapshot.kube.informer import Informer
from dynamo_snapshot.kube.kube import (
    CONFIG_MAP,
    LEASE,
    NODE,
    POD,
    ApiError,
    Kube,
    ResourceKind,
    conflict_retry,
    is_already_exists,
    is_conflict,
    is_gone,
    is_not_found,
    object_key,
)
from tests.kube.helpers import eventually


def test_paths() -> None:
    assert POD.path("ns") == "/api/v1/namespaces/ns/pods"
    assert POD.path() == "/api/v1/pods"  # all namespaces
    assert POD.path("ns", "p", "status") == "/api/v1/namespaces/ns/pods/p/status"
    assert NODE.path(None, "n1") == "/api/v1/nodes/n1"
    assert NODE.path("ignored", "n1") == "/api/v1/nodes/n1"
    assert LEASE.path("kube-system", "x") == "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/x"
    dgd = ResourceKind.custom("nvidia.com", "v1alpha1", "DynamoGraphDeployment")
    assert dgd.plural == "dynamographdeployments"
    assert dgd.api_version == "nvidia.com/v1alpha1"
    assert CONFIG_MAP.api_version == "v1"
    with pytest.raises(ValueError, match="namespaced"):
        POD.path(None, "p")


def test_api_error_from_status_body() -> None:
    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \\"x\\" already exists",'
    body += b'"reason":"AlreadyExists","code":409}'
    err = ApiError.from_body(409, body)
    assert (err.status, err.reason) == (409, "AlreadyExists")
    assert is_already_exists(err)
    assert not is_conflict(err), "AlreadyExists is a 409 but not an optimistic-concurrency conflict"
    plain = ApiError.from_body(503, b"upstream connect error")
    assert plain.status == 503
    assert "upstream" in plain.message
    assert is_not_found(ApiError(404, "NotFound"))
    assert is_gone(ApiError(410, "Expired"))
    assert is_conflict(ApiError(409, "Conflict"))
    assert not is_not_found(RuntimeError("404"))


def test_object_key() -> None:
    assert object_key({"metadata": {"name": "a", "namespace": "ns"}}) == "ns/a"
    assert object_key({"metadata": {"name": "node-1"}}) == "node-1"


async def test_conflict_retry_retries_only_conflicts() -> None:
    calls = 0

    async def rmw() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ApiError(409, "Conflict", "the object has been modified")
        return "ok"

    assert await conflict_retry(rmw, attempts=5) == "ok"
    assert calls == 3

    async def always_conflicts() -> None:
        raise ApiError(409, "Conflict")

    with pytest.raises(ApiError):
        await conflict_retry(always_conflicts, attempts=2)

    async def not_found() -> None:
        nonlocal calls
        calls += 1
        raise ApiError(404, "NotFound")

    calls = 0
    with pytest.raises(ApiError):
        await conflict_retry(not_found)
    assert calls == 1


async def test_informer_backs_off_on_connection_errors_and_stops_cleanly() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = client.Configuration(host=f"https://127.0.0.1:{port}")
    async with client.ApiClient(cfg) as api:
        kind = ResourceKind("", "v1", "configmaps", "ConfigMapUnreachable")
        inf = Informer(Kube(api, request_timeout=2), kind, backoff_base=0.01, backoff_cap=0.05)
        labels = {"kind": kind.kind, "reason": "connection"}

        def restarts() -> float:
            return REGISTRY.get_sample_value("dynsnap_informer_watch_restarts_total", labels) or 0.0

        inf.start()
        await eventually(lambda: restarts() >= 3, what="three reconnect attempts")
        assert not inf.has_synced.is_set()
        await asyncio.wait_for(inf.stop(), 2)
