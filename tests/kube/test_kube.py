"""The REST client against the real kube-apiserver: CRUD, the three patch kinds, status, delete, watch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from dynamo_snapshot.kube.kube import (
    CONFIG_MAP,
    NAMESPACE,
    POD,
    ApiError,
    Kube,
    Obj,
    ResourceKind,
    conflict_retry,
    is_already_exists,
    is_conflict,
    is_gone,
    is_not_found,
    load_client,
)
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.kube.helpers import eventually_async

pytestmark = pytest.mark.cluster

SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")


async def wait_default_service_account(kube: Kube, namespace: str) -> None:
    """Pods are rejected until the controller-manager has created the namespace's default account."""

    async def exists() -> bool:
        try:
            await kube.get(SERVICE_ACCOUNT, "default", namespace)
            return True
        except ApiError as e:
            if not is_not_found(e):
                raise
            return False

    await eventually_async(exists, within=30, what="the default service account")


async def test_configmap_crud_merge_and_json_patch(kube: Kube, namespace: str) -> None:
    cm = await kube.create(
        CONFIG_MAP, {"metadata": {"name": "a", "labels": {"app": "x"}}, "data": {"v": "1"}}, namespace
    )
    assert cm["metadata"]["resourceVersion"]
    got = await kube.get(CONFIG_MAP, "a", namespace)
    assert got["data"] == {"v": "1"}
    with pytest.raises(ApiError) as dup:
        await kube.create(CONFIG_MAP, {"metadata": {"name": "a"}}, namespace)
    assert is_already_exists(dup.value)

    patched = await kube.merge_patch(CONFIG_MAP, "a", {"data": {"w": "2"}}, namespace)
    assert patched["data"] == {"v": "1", "w": "2"}
    # merge patch with a null deletes the key
    patched = await kube.merge_patch(CONFIG_MAP, "a", {"data": {"w": None}}, namespace)
    assert patched["data"] == {"v": "1"}

    ops = [
        {"op": "test", "path": "/data/v", "value": "1"},
        {"op": "replace", "path": "/data/v", "value": "3"},
    ]
    assert (await kube.json_patch(CONFIG_MAP, "a", ops, namespace))["data"]["v"] == "3"
    with pytest.raises(ApiError) as failed_test:  # the "test" op no longer holds: nothing is written
        await kube.json_patch(CONFIG_MAP, "a", ops, namespace)
    assert failed_test.value.status in (409, 422), failed_test.value
    assert (await kube.get(CONFIG_MAP, "a", namespace))["data"]["v"] == "3"

    # optimistic concurrency: a PUT carrying a stale resourceVersion is refused
    stale = dict(got)
    stale["data"] = {"v": "stale"}
    with pytest.raises(ApiError) as conflict:
        await kube.replace(CONFIG_MAP, stale)
    assert is_conflict(conflict.value)

    with pytest.raises(ApiError) as missing:
        await kube.get(CONFIG_MAP, "nope", namespace)
    assert is_not_found(missing.value)
    assert "nope" in missing.value.message


async def test_conflict_retry_wins_a_real_race(kube: Kube, namespace: str) -> None:
    await kube.create(CONFIG_MAP, {"metadata": {"name": "counter"}, "data": {"n": "0"}}, namespace)
    attempts = 0

    async def increment() -> Obj:
        nonlocal attempts
        attempts += 1
        cm = await kube.get(CONFIG_MAP, "counter", namespace)
        if attempts == 1:  # someone else writes between our read and our write
            await kube.merge_patch(CONFIG_MAP, "counter", {"data": {"n": "10"}}, namespace)
        cm["data"]["n"] = str(int(cm["data"]["n"]) + 1)
        return await kube.replace(CONFIG_MAP, cm)

    result = await conflict_retry(increment)
    assert attempts == 2
    assert result["data"]["n"] == "11"


async def test_server_side_apply_ownership_and_force(kube: Kube, namespace: str) -> None:
    desired = {"metadata": {"name": "ssa", "namespace": namespace}, "data": {"owned": "by-a"}}
    out = await kube.apply(CONFIG_MAP, desired, field_manager="manager-a")
    assert out["data"] == {"owned": "by-a"}
    again = await kube.apply(CONFIG_MAP, desired, field_manager="manager-a")
    assert again["metadata"]["resourceVersion"] == out["metadata"]["resourceVersion"], "apply is idempotent"

    other = {"metadata": {"name": "ssa", "namespace": namespace}, "data": {"owned": "by-b"}}
    with pytest.raises(ApiError) as conflict:
        await kube.apply(CONFIG_MAP, other, field_manager="manager-b")
    assert is_conflict(conflict.value)
    forced = await kube.apply(CONFIG_MAP, other, field_manager="manager-b", force=True)
    assert forced["data"] == {"owned": "by-b"}
    managers = {m["manager"] for m in forced["metadata"]["managedFields"]}
    assert "manager-b" in managers
    # the client's default field manager is used when none is given
    mine = await kube.apply(CONFIG_MAP, {"metadata": {"name": "ssa2", "namespace": namespace}, "data": {}})
    assert {m["manager"] for m in mine["metadata"]["managedFields"]} == {"dynsnap-runtime-test"}


async def test_list_selectors_and_pagination(kube: Kube, namespace: str) -> None:
    for i in range(5):
        labels = {"tier": "even" if i % 2 == 0 else "odd"}
        await kube.create(CONFIG_MAP, {"metadata": {"name": f"cm-{i}", "labels": labels}}, namespace)
    page = await kube.list(CONFIG_MAP, namespace, label_selector="tier", limit=2)
    assert len(page["items"]) == 2
    assert page["metadata"].get("continue"), "a limited list must hand out a continue token"
    items, rv = await kube.list_all(CONFIG_MAP, namespace, label_selector="tier", page_size=2)
    assert sorted(i["metadata"]["name"] for i in items) == [f"cm-{i}" for i in range(5)]
    assert int(rv) > 0
    even, _ = await kube.list_all(CONFIG_MAP, namespace, label_selector="tier=even")
    assert len(even) == 3
    named, _ = await kube.list_all(CONFIG_MAP, namespace, field_selector="metadata.name=cm-3")
    assert [i["metadata"]["name"] for i in named] == ["cm-3"]
    everywhere, _ = await kube.list_all(CONFIG_MAP, None, label_selector="tier=odd")
    assert {i["metadata"]["namespace"] for i in everywhere} >= {namespace}


async def test_delete_preconditions(kube: Kube, namespace: str) -> None:
    cm = await kube.create(CONFIG_MAP, {"metadata": {"name": "d"}}, namespace)
    with pytest.raises(ApiError) as wrong_uid:
        await kube.delete(CONFIG_MAP, "d", namespace, uid="00000000-0000-0000-0000-000000000000")
    assert is_conflict(wrong_uid.value)
    await kube.merge_patch(CONFIG_MAP, "d", {"data": {"x": "y"}}, namespace)
    with pytest.raises(ApiError) as stale_rv:
        await kube.delete(CONFIG_MAP, "d", namespace, resource_version=cm["metadata"]["resourceVersion"])
    assert is_conflict(stale_rv.value)
    await kube.delete(CONFIG_MAP, "d", namespace, uid=cm["metadata"]["uid"], propagation_policy="Foreground")
    await eventually_async(lambda: _gone(kube, CONFIG_MAP, "d", namespace), what="configmap deleted")


async def drain(stream: AsyncGenerator[tuple[str, Obj], None]) -> int:
    """Consume a watch to its end; returns how many events it gave."""
    n = 0
    async with aclosing(stream) as events:
        async for _ in events:
            n += 1
    return n


async def _gone(kube: Kube, kind: ResourceKind, name: str, namespace: str) -> bool:
    try:
        await kube.get(kind, name, namespace)
        return False
    except ApiError as e:
        if is_not_found(e):
            return True
        raise


async def test_pod_status_patch_apply_and_replace(kube: Kube, namespace: str) -> None:
    await wait_default_service_account(kube, namespace)
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "worker:test"}], "nodeName": "no-such-node"},
    }
    created = await kube.create(POD, pod, namespace)
    condition = {"type": "dynamo-snapshot.dev/Restored", "status": "True", "reason": "Test"}
    patched = await kube.patch_status(POD, "p", {"conditions": [condition]}, namespace)
    assert any(c["type"] == condition["type"] for c in patched["status"]["conditions"])

    # status written through the main resource is ignored: only the subresource changes it
    main = await kube.merge_patch(POD, "p", {"status": {"message": "ignored"}}, namespace)
    assert "message" not in main["status"]

    applied = await kube.apply(
        POD,
        {"metadata": {"name": "p", "namespace": namespace}, "status": {"message": "applied"}},
        field_manager="status-writer",
        subresource="status",
    )
    assert applied["status"]["message"] == "applied"

    stale = dict(created)
    stale["status"] = {"message": "stale"}
    with pytest.raises(ApiError) as conflict:
        await kube.replace_status(POD, stale)
    assert is_conflict(conflict.value)
    fresh = await kube.get(POD, "p", namespace)
    fresh["status"]["message"] = "replaced"
    assert (await kube.replace_status(POD, fresh))["status"]["message"] == "replaced"
    await kube.delete(POD, "p", namespace, grace_period_seconds=0, propagation_policy="Background")


async def test_custom_resource_status(kube: Kube, namespace: str, gadgets: ResourceKind) -> None:
    await kube.create(gadgets, {"metadata": {"name": "g"}, "spec": {"size": 1}}, namespace)
    out = await kube.patch_status(gadgets, "g", {"phase": "Ready", "observedGeneration": 1}, namespace)
    assert out["status"]["phase"] == "Ready"
    assert out["spec"] == {"size": 1}
    both = {"spec": {"size": 2}, "status": {"phase": "X"}}
    spec_only = await kube.merge_patch(gadgets, "g", both, namespace)
    assert spec_only["status"]["phase"] == "Ready"
    assert spec_only["metadata"]["generation"] == 2


async def test_watch_streams_large_objects_in_order(kube: Kube, namespace: str) -> None:
    _, rv = await kube.list_all(CONFIG_MAP, namespace)
    big = "x" * 1_000_000  # near ConfigMap's 1 MiB cap: one event line spans many network chunks
    seen: list[tuple[str, str, int]] = []

    async def consume() -> None:
        # Only "w": the controller-manager publishes kube-root-ca.crt into new namespaces at any moment.
        stream = kube.watch(
            CONFIG_MAP, namespace, resource_version=rv, timeout_seconds=30, field_selector="metadata.name=w"
        )
        async with aclosing(stream) as events:
            async for etype, obj in events:
                if etype == "BOOKMARK":
                    continue
                seen.append((etype, obj["metadata"]["name"], len((obj.get("data") or {}).get("big", ""))))
                if etype == "DELETED":
                    return

    task = asyncio.create_task(consume())
    await kube.create(CONFIG_MAP, {"metadata": {"name": "w"}, "data": {"big": big}}, namespace)
    await kube.merge_patch(CONFIG_MAP, "w", {"data": {"big": big + "y"}}, namespace)
    await kube.delete(CONFIG_MAP, "w", namespace)
    async with asyncio.timeout(30):
        await task
    assert seen == [
        ("ADDED", "w", len(big)),
        ("MODIFIED", "w", len(big) + 1),
        ("DELETED", "w", len(big) + 1),
    ]


async def test_watch_from_expired_resource_version_is_gone(
    kube: Kube, namespace: str, gadgets: ResourceKind
) -> None:
    """The CRD's watch cache began at the revision the CRD was installed, so "1" is too old: the apiserver
    answers 200 and then an ERROR event carrying a 410 Expired Status."""
    with pytest.raises(ApiError) as gone:
        await drain(kube.watch(gadgets, namespace, resource_version="1", timeout_seconds=10))
    assert is_gone(gone.value)
    assert gone.value.reason == "Expired"


async def test_watch_read_timeout_fires_on_silence(kube: Kube, namespace: str) -> None:
    _, rv = await kube.list_all(CONFIG_MAP, namespace)
    started = time.monotonic()
    quiet = kube.watch(
        CONFIG_MAP,
        namespace,
        resource_version=rv,
        timeout_seconds=60,
        read_timeout=0.5,
        field_selector="metadata.name=nobody",  # kube-root-ca.crt may land in a new namespace at any time
    )
    with pytest.raises(TimeoutError):
        await drain(quiet)
    assert time.monotonic() - started < 10


async def test_load_client_from_kubeconfig(cluster: LocalCluster) -> None:
    async with await load_client(str(cluster.kubeconfig)) as api:
        ns = await Kube(api).get(NAMESPACE, "default")
    assert ns["metadata"]["name"] == "default"
