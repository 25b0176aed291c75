"""Informers against the real kube-apiserver: events, cache, index, scope, watch restarts and 410 recovery."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.kube.informer import EventHandler, Informer
from dynamo_snapshot.kube.kube import CONFIG_MAP, Kube, Obj, ResourceKind
from tests.kube.helpers import eventually

pytestmark = pytest.mark.cluster

Seen = list[tuple[str, str, str | None]]


def recorder(seen: Seen) -> EventHandler:
    """A handler that records (type, key, old resourceVersion)."""

    async def handler(etype: str, obj: Obj, old: Obj | None) -> None:
        meta = obj["metadata"]
        key = f"{meta.get('namespace', '')}/{meta['name']}".lstrip("/")
        seen.append((etype, key, old["metadata"]["resourceVersion"] if old else None))

    return handler


def restarts(kind: str, reason: str) -> float:
    labels = {"kind": kind, "reason": reason}
    return REGISTRY.get_sample_value("dynsnap_informer_watch_restarts_total", labels) or 0.0


async def test_informer_sees_add_modify_delete_with_cache_and_index(kube: Kube, namespace: str) -> None:
    def cm(name: str, role: str, app: str = "inf") -> Obj:
        return {"metadata": {"name": name, "labels": {"app": app, "role": role}}, "data": {"v": "0"}}

    await kube.create(CONFIG_MAP, cm("before", "worker"), namespace)
    await kube.create(CONFIG_MAP, cm("other-app", "worker", app="else"), namespace)
    inf = Informer(kube, CONFIG_MAP, namespace=namespace, label_selector="app=inf", indexed_labels=["role"])
    seen: Seen = []
    inf.add_handler(recorder(seen))

    async def broken(etype: str, obj: Obj, old: Obj | None) -> None:
        raise RuntimeError("a buggy handler must not stop the informer or the others")

    inf.add_handler(broken)
    inf.start()
    try:
        async with asyncio.timeout(10):
            await inf.wait_synced()
        assert seen == [("ADDED", f"{namespace}/before", None)], "the initial list arrives as ADDED"
        before = inf.get(f"{namespace}/before")
        assert before is not None
        assert "managedFields" not in before["metadata"], "the default transform drops managedFields"
        assert before["kind"] == "ConfigMap", "list items are given the kind the list omits"
        assert inf.get(f"{namespace}/other-app") is None, "the label selector scopes the cache"

        created = await kube.create(CONFIG_MAP, cm("x", "worker"), namespace)
        await eventually(lambda: len(seen) == 2, what="ADDED x")
        assert {o["metadata"]["name"] for o in inf.by_label("role", "worker")} == {"before", "x"}

        await kube.merge_patch(CONFIG_MAP, "x", {"metadata": {"labels": {"role": "frontend"}}}, namespace)
        await eventually(lambda: len(seen) == 3, what="MODIFIED x")
        assert seen[2] == ("MODIFIED", f"{namespace}/x", created["metadata"]["resourceVersion"])
        assert [o["metadata"]["name"] for o in inf.by_label("role", "frontend")] == ["x"]
        assert [o["metadata"]["name"] for o in inf.by_label("role", "worker")] == ["before"]
        # a label not declared in indexed_labels is indexed on first use
        assert sorted(o["metadata"]["name"] for o in inf.by_label("app", "inf")) == ["before", "x"]

        await kube.delete(CONFIG_MAP, "x", namespace)
        await eventually(lambda: len(seen) == 4, what="DELETED x")
        assert seen[3][0] == "DELETED"
        assert inf.get(f"{namespace}/x") is None
        assert inf.by_label("role", "frontend") == []
        assert sorted(inf.keys()) == [f"{namespace}/before"]
        assert len(inf.list()) == 1
    finally:
        await inf.stop()


async def test_all_namespaces_scope(kube: Kube, namespace: str) -> None:
    marker = f"m-{uuid.uuid4().hex[:8]}"
    inf = Informer(kube, CONFIG_MAP, label_selector=f"marker={marker}")
    inf.start()
    try:
        async with asyncio.timeout(10):
            await inf.wait_synced()
        assert len(inf) == 0
        await kube.create(CONFIG_MAP, {"metadata": {"name": "c", "labels": {"marker": marker}}}, namespace)
        await kube.create(CONFIG_MAP, {"metadata": {"name": "c", "labels": {"marker": marker}}}, "default")
        await eventually(lambda: len(inf) == 2, what="both namespaces")
        assert sorted(inf.keys()) == sorted([f"{namespace}/c", "default/c"])
    finally:
        await inf.stop()
        await kube.delete(CONFIG_MAP, "c", "default")


async def test_watch_timeouts_resume_without_duplicates(kube: Kube, namespace: str) -> None:
    kind = ResourceKind("", "v1", "configmaps", "ConfigMap")
    inf = Informer(kube, kind, namespace=namespace, watch_timeout=1)
    seen: Seen = []
    inf.add_handler(recorder(seen))
    timeouts_before = restarts("ConfigMap", "timeout")
    inf.start()
    try:
        async with asyncio.timeout(10):
            await inf.wait_synced()
        names = [f"{namespace}/t{i}" for i in range(3)]
        for name in names:
            await kube.create(CONFIG_MAP, {"metadata": {"name": name.split("/")[1]}}, namespace)
            await asyncio.sleep(1.3)  # outlive the server-side watch timeout

        # Only our objects count: kube-controller-manager publishes kube-root-ca.crt into a new
        # namespace whenever it gets to it, which may be after the informer synced.
        def ours() -> list[tuple[str, str]]:
            return [(etype, key) for etype, key, _ in seen if key in names]

        await eventually(lambda: len(ours()) >= 3, what="three ADDED")
        await asyncio.sleep(1.3)  # one more resume: a replay from a stale resourceVersion would show here
        assert restarts("ConfigMap", "timeout") - timeouts_before >= 2
        assert ours() == [("ADDED", n) for n in names], "resuming from the last resourceVersion"
    finally:
        await inf.stop()


async def test_recovers_from_410_by_relisting_and_diffing(
    kube: Kube, namespace: str, gadgets: ResourceKind
) -> None:
    """A real 410: the informer is stopped (a long disconnection), the world changes, and its resume
    point is rewound to resourceVersion "1", which the apiserver rejects with 410 Expired because the
    CRD's watch cache starts at the CRD's creation.  The informer must re-list and emit the difference."""
    for name in ("g1", "g2", "g3"):
        await kube.create(gadgets, {"metadata": {"name": name}, "spec": {"n": 0}}, namespace)
    inf = Informer(kube, gadgets, namespace=namespace)
    seen: Seen = []
    inf.add_handler(recorder(seen))
    inf.start()
    try:
        async with asyncio.timeout(10):
            await inf.wait_synced()
        assert len(seen) == 3
        await inf.stop()

        g2_old_rv = inf.get(f"{namespace}/g2")["metadata"]["resourceVersion"]  # type: ignore[index]
        await kube.delete(gadgets, "g1", namespace)
        await kube.merge_patch(gadgets, "g2", {"spec": {"n": 1}}, namespace)
        await kube.create(gadgets, {"metadata": {"name": "g4"}}, namespace)
        inf._resource_version = "1"  # as if etcd compacted past our resume point while we were away
        gone_before = restarts("Gadget", "gone")
        seen.clear()

        inf.start()
        await eventually(lambda: len(seen) == 3, what="the re-list diff")
        assert restarts("Gadget", "gone") == gone_before + 1, "the apiserver answered 410"
        assert sorted(seen) == sorted(
            [
                ("DELETED", f"{namespace}/g1", seen[0][2]),
                ("MODIFIED", f"{namespace}/g2", g2_old_rv),
                ("ADDED", f"{namespace}/g4", None),
            ]
        )
        assert seen[0][0] == "DELETED", "vanished objects are reported before the re-listed ones"
        assert sorted(inf.keys()) == [f"{namespace}/g2", f"{namespace}/g3", f"{namespace}/g4"]
        assert inf.get(f"{namespace}/g2")["spec"] == {"n": 1}  # type: ignore[index]

        # and the watch carries on live from the re-list's resourceVersion
        await kube.create(gadgets, {"metadata": {"name": "g5"}}, namespace)
        await eventually(lambda: len(seen) == 4, what="ADDED g5 after recovery")
        assert seen[3][:2] == ("ADDED", f"{namespace}/g5")
    finally:
        await inf.stop()


async def test_a_caller_waiting_for_an_objects_next_change_wakes_with_it(kube: Kube, namespace: str) -> None:
    await kube.create(CONFIG_MAP, {"metadata": {"name": "watched"}, "data": {"v": "0"}}, namespace)
    inf = Informer(kube, CONFIG_MAP, namespace=namespace)
    inf.start()
    try:
        async with asyncio.timeout(10):
            await inf.wait_synced()
        key = f"{namespace}/watched"
        # Nothing changes: the wait ends at its limit.
        started = asyncio.get_running_loop().time()
        await inf.next_change(key, 0.3)
        assert asyncio.get_running_loop().time() - started >= 0.3

        waiting = asyncio.create_task(inf.next_change(key, 30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await kube.merge_patch(CONFIG_MAP, "watched", {"data": {"v": "1"}}, namespace)
        async with asyncio.timeout(10):
            await waiting
        cached = inf.get(key)
        assert cached is not None
        assert cached["data"] == {"v": "1"}, "woken before the change was in the cache"
    finally:
        await inf.stop()
