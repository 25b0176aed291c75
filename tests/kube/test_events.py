"""EventRecorder against the real apiserver: repeats fold into one Event, failures never reach callers."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dynamo_snapshot.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from dynamo_snapshot.kube.kube import CONFIG_MAP, EVENT, Kube, Obj

pytestmark = pytest.mark.cluster


async def events_for(kube: Kube, namespace: str, name: str) -> list[Obj]:
    items, _ = await kube.list_all(EVENT, namespace, field_selector=f"involvedObject.name={name}")
    return sorted(items, key=lambda e: (e["type"], e["reason"], e["message"]))


async def test_repeats_are_aggregated(kube: Kube, namespace: str) -> None:
    cm = await kube.create(CONFIG_MAP, {"metadata": {"name": "target"}}, namespace)
    rec = EventRecorder(kube, "dynamo-snapshot-controller", instance="controller-0")
    for _ in range(3):
        rec.record(cm, NORMAL, "Restored", "restored from checkpoint abc")
    rec.record(cm, WARNING, "RestoreFailed", "criu exited 1")
    rec.record(cm, NORMAL, "Restored", "restored from checkpoint def")
    async with asyncio.timeout(10):
        await rec.flush()

    events = await events_for(kube, namespace, "target")
    assert [(e["type"], e["reason"], e["message"], e["count"]) for e in events] == [
        (NORMAL, "Restored", "restored from checkpoint abc", 3),
        (NORMAL, "Restored", "restored from checkpoint def", 1),
        (WARNING, "RestoreFailed", "criu exited 1", 1),
    ]
    first = events[0]
    assert first["involvedObject"] == {
        "kind": "ConfigMap",
        "name": "target",
        "namespace": namespace,
        "uid": cm["metadata"]["uid"],
        "apiVersion": "v1",
    }
    assert first["source"] == {"component": "dynamo-snapshot-controller"}
    assert first["reportingComponent"] == "dynamo-snapshot-controller"
    assert first["lastTimestamp"] >= first["firstTimestamp"]
    await rec.close()


async def test_cluster_scoped_object_events_go_to_default(kube: Kube, namespace: str) -> None:
    rec = EventRecorder(kube, "dynamo-snapshot-controller")
    node = ObjectRef(kind="Node", name=f"node-for-{namespace}", api_version="v1")
    rec.record(node, WARNING, "GPUUnhealthy", "XID 79")
    await rec.close()
    events = await events_for(kube, "default", node.name)
    assert [(e["reason"], e["count"]) for e in events] == [("GPUUnhealthy", 1)]
    await kube.delete(EVENT, events[0]["metadata"]["name"], "default")


async def test_recreated_after_the_event_expired(kube: Kube, namespace: str) -> None:
    cm = await kube.create(CONFIG_MAP, {"metadata": {"name": "ttl"}}, namespace)
    rec = EventRecorder(kube, "dynamo-snapshot-controller")
    rec.record(cm, NORMAL, "Scaled", "to 2")
    await rec.flush()
    (event,) = await events_for(kube, namespace, "ttl")
    await kube.delete(EVENT, event["metadata"]["name"], namespace)  # what the apiserver's event TTL does
    rec.record(cm, NORMAL, "Scaled", "to 2")
    await rec.close()
    (again,) = await events_for(kube, namespace, "ttl")
    assert again["count"] == 1
    assert again["metadata"]["name"] != event["metadata"]["name"]


async def test_failures_are_logged_not_raised(kube: Kube, caplog: pytest.LogCaptureFixture) -> None:
    rec = EventRecorder(kube, "dynamo-snapshot-controller")
    missing_ns = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "no-such-ns"}}
    with caplog.at_level(logging.WARNING, logger="dynamo_snapshot.kube.events"):
        rec.record(missing_ns, NORMAL, "Anything", "goes nowhere")
        rec.record({"not": "an object"}, NORMAL, "Broken", "no metadata")
        await rec.close()
    messages = [r.message for r in caplog.records]
    assert messages.count("event write failed") == 1, messages  # the apiserver refused it
    assert messages.count("event about an object without kind or name dropped") == 1, messages


async def test_events_are_logged_once_at_their_level(
    kube: Kube, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The log carries each Event (a Warning as a warning), and one said again only at debug."""
    cm = await kube.create(CONFIG_MAP, {"metadata": {"name": "logged"}}, namespace)
    rec = EventRecorder(kube, "dynamo-snapshot-controller")
    caplog.set_level(logging.DEBUG, logger="dynamo_snapshot.kube.events")
    rec.record(cm, WARNING, "WorkerLost", "pod p lost")
    async with asyncio.timeout(10):
        await rec.flush()
    rec.record(cm, WARNING, "WorkerLost", "pod p lost")
    rec.record(cm, NORMAL, "ScaledUp", "created 1 pod")
    async with asyncio.timeout(10):
        await rec.flush()
    said = [
        (r.levelno, getattr(r, "object", None), getattr(r, "reason", None), getattr(r, "event_message", None))
        for r in caplog.records
        if r.getMessage() == "event"
    ]
    assert said == [
        (logging.WARNING, f"ConfigMap/{namespace}/logged", "WorkerLost", "pod p lost"),
        (logging.DEBUG, f"ConfigMap/{namespace}/logged", "WorkerLost", "pod p lost"),
        (logging.INFO, f"ConfigMap/{namespace}/logged", "ScaledUp", "created 1 pod"),
    ]
    await rec.close()
