"""storage.type s3 on the real kubelet node: a PodSnapshot of a kubelet pod is captured and written to a real
S3 server (SeaweedFS) before it is Ready; on a node whose store lacks it (the node's copy removed, the agent
started again with a node cache, as the chart's) a restore-from pod gets it fetched into the node cache,
every chunk checked, while the kubelet starts the pod, and serves on its own pod IP; with the store's
object damaged the restore fails by name, the pod says so and nothing is kept; with the memory pages
streamed (--s3-stream-pages) CRIU restores into the pod's namespaces with lazy pages, which come through
the page server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore, artifact_key
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot.kube import POD, Obj
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.helpers.kubelet_stack import Stack, captured_worker, eventually, first_answer, snapshot_pod

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]


def fetches() -> float:
    sample = "dynsnap_agent_object_store_transfers_total"
    return REGISTRY.get_sample_value(sample, {"op": "fetch", "result": "done"}) or 0.0


async def _objects(tmp_path: Path, s3_server: LocalS3) -> ObjectStore:
    bucket = await s3_server.new_bucket()
    creds = s3_server.write_credentials(tmp_path / "s3-credentials")
    return ObjectStore(S3Location(endpoint=s3_server.endpoint, bucket=bucket, prefix="cluster/"), creds)


async def _restore_pod(s: Stack, node: RealNode, name: str) -> None:
    pod = snapshot_pod(node, name, {"image": node.worker_image.name}, standby=True, restartPolicy="Never")
    pod["metadata"].update(namespace=s.namespace, annotations={protocol.ANNOTATION_RESTORE_FROM: "snap"})
    await s.kube.create(POD, pod)


def _annotation(pod: Obj, name: str) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(protocol.per_container(name, "main"))


async def _ended(s: Stack, name: str) -> Obj:
    async def done() -> Obj | None:
        pod = await s.kube.get(POD, name, s.namespace)
        state = _annotation(pod, protocol.ANNOTATION_RESTORE_STATUS)
        return pod if state == "failed" or (state == "completed" and pod["status"].get("podIP")) else None

    ended: Obj = await eventually(done, 180, f"the restore of {name} to end")
    return ended


async def test_a_checkpoint_goes_through_the_object_store_to_a_node_without_it(
    stack: Stack, real_node: RealNode, s3_server: LocalS3, tmp_path: Path
) -> None:
    s = stack
    objects = await _objects(tmp_path, s3_server)
    s.start_agent(objects=objects)
    _, snapshot = await captured_worker(s, "s3-source")
    key = artifact_key(s.namespace, snapshot["metadata"]["uid"])
    prefix = f"cluster/{key}/"
    async with s3_server.client() as client:
        listed = await client.list_objects_v2(Bucket=objects.location.bucket, Prefix=prefix)
    sizes = {o["Key"].removeprefix(prefix): o["Size"] for o in listed.get("Contents") or []}
    names = set(sizes)
    local = ArtifactStore(s.store)
    assert names == {"manifest.json", *(f.path for f in local.open(key).manifest.files)}

    # Another node: its store does not hold the artifact.
    await s.kill_agent()
    await asyncio.to_thread(local.delete, key)
    fetched = fetches()
    cache = ArtifactCache(tmp_path / "cache", 1 << 30)
    s.start_agent(objects=objects, cache=cache)
    await _restore_pod(s, real_node, "s3-restored")
    pod = await _ended(s, "s3-restored")
    assert _annotation(pod, protocol.ANNOTATION_RESTORE_STATUS) == "completed", pod["metadata"]["annotations"]
    timings: dict[str, Any] = json.loads(pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_TIMINGS])
    assert cache.store.exists(key), "not fetched into the node cache"
    assert not local.exists(key)
    assert fetches() == fetched + 1
    assert "(fetched from the object store)" in (_annotation(pod, protocol.ANNOTATION_RESTORE_MESSAGE) or "")

    assert await first_answer(pod["status"]["podIP"])
    assert timings, "the restore's timings are on the pod"

    # The node's copy gone again and the store's pages object damaged: refused by name, nothing kept.
    await s.kill_agent()
    await asyncio.to_thread(cache.discard, key)
    biggest = max(sizes, key=lambda n: sizes[n])
    async with s3_server.client() as client:
        await client.put_object(Bucket=objects.location.bucket, Key=prefix + biggest, Body=b"not the pages")
    s.start_agent(objects=objects, cache=cache)
    await _restore_pod(s, real_node, "s3-damaged")
    pod = await _ended(s, "s3-damaged")
    message = _annotation(pod, protocol.ANNOTATION_RESTORE_MESSAGE) or ""
    assert _annotation(pod, protocol.ANNOTATION_RESTORE_STATUS) == "failed"
    assert biggest in message, message
    assert cache.store.list() == []
    assert not local.exists(key)


async def test_a_restore_pod_streams_its_memory_pages_from_the_object_store(
    stack: Stack, real_node: RealNode, s3_server: LocalS3, tmp_path: Path
) -> None:
    """--s3-stream-pages on the kubelet node: CRIU restores into the pod's namespaces with --lazy-pages,
    its pages served from the fetch as they are checked; the worker serves on its pod IP."""
    s = stack
    objects = await _objects(tmp_path, s3_server)
    s.start_agent(objects=objects)
    _, snapshot = await captured_worker(s, "s3-stream-source")
    key = artifact_key(s.namespace, snapshot["metadata"]["uid"])
    await s.kill_agent()
    local = ArtifactStore(s.store)
    await asyncio.to_thread(local.delete, key)
    cache = ArtifactCache(tmp_path / "cache", 1 << 30)
    runtime = s.start_agent(objects=objects, cache=cache, s3_stream_pages=True)
    assert runtime.streams_pages
    streamed = REGISTRY.get_sample_value("dynsnap_agent_streamed_page_bytes_total") or 0.0
    await _restore_pod(s, real_node, "s3-streamed")
    pod = await _ended(s, "s3-streamed")
    assert _annotation(pod, protocol.ANNOTATION_RESTORE_STATUS) == "completed", pod["metadata"]["annotations"]
    assert await first_answer(pod["status"]["podIP"])
    assert cache.store.exists(key), "not fetched into the node cache"

    async def moved() -> float | None:
        now = REGISTRY.get_sample_value("dynsnap_agent_streamed_page_bytes_total") or 0.0
        return now - streamed if now > streamed else None

    # The worker's memory came through the page server: megabytes of it (its 24 MiB of weights at least).
    assert await eventually(moved, 60, "the streamed pages to be counted") > 16 << 20
