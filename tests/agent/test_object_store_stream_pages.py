"""A restore whose memory pages stream in (agent --s3-stream-pages), against a real SeaweedFS server behind
a slow link and real CRIU: CRIU brings the worker back from its images before its pages are in, the pages
come through the page server as the fetch checks them, and the worker finds its memory intact; a pages
chunk that arrives damaged never reaches it: the tree is stopped and the failure counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpoint_worker, local_executor, node_with_cache
from tests.conftest import SlowS3
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "5151515151515151"
# Six 64 MiB chunks of pages; the restore waits for the two that hold what it cannot take lazily (the
# first and the last: the worker's stacks and libraries lie at either end of its address space).
STATE_MIB = 320
# The pages take about 5 s to come; the images before them a fraction of one.
LINK_BYTES_PER_S = 64e6
FAILED = ("dynsnap_agent_failures_total", {"op": "restore"})


@pytest.fixture
async def slow(slow_s3: SlowS3, s3_location: S3Location) -> AsyncIterator[S3Location]:
    async with slow_s3(s3_location, LINK_BYTES_PER_S) as far:
        yield far


async def _checkpointed(tmp: Path, criu_bin: Path, objects: ObjectStore) -> tuple[str, Path, int]:
    """The CPU worker checkpointed on node a and written to the store: the manifest digest, the control
    dir the restored worker reports into, and the bytes of its pages images."""
    a, runtime = local_executor(
        tmp / "a", criu_bin, compress_pages=False, objects=objects, kind=Executor, runtime_kind=ProcessRuntime
    )
    source = await checkpoint_worker(a, runtime, WORKER, HASH, {"WORKER_STATE_MIB": str(STATE_MIB)})
    manifest = a.store.open(HASH).manifest
    assert manifest.digest is not None
    pages = sum(f.size for f in manifest.files if f.path.startswith("criu/pages-"))
    return manifest.digest, source.control_dir, pages


async def test_criu_restores_the_worker_before_its_pages_are_in_and_its_memory_comes_intact(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl, pages = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds))
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds), s3_stream_pages=True)
    assert node.streams_pages

    started = time.monotonic()
    outcome = await node.restore("restored", HASH, manifest_digest=digest)
    back = time.monotonic() - started
    try:
        verdict = await await_json(ctl / "verify.json", within=60, settle=0.05)
        assert verdict["restored"] is True
        assert verdict["digest_after"] == verdict["digest_before"], "memory changed across the restore"
        whole = time.monotonic() - started
    finally:
        await runtime.stop("restored")
    # Back well before the pages could all be in; the worker's check of its memory waited for them.
    transfer = pages / LINK_BYTES_PER_S
    assert back < transfer * 0.6, (
        f"restored after {back:.2f} s, pages take {transfer:.2f} s: {outcome.timings}"
    )
    assert whole > transfer * 0.8, f"the worker's memory was whole after {whole:.2f} s of {transfer:.2f} s"
    assert outcome.source == "object-store"
    published = cache.store.open(HASH)
    assert published.manifest.digest == digest


async def _damage(s3_server: LocalS3, location: S3Location, at: float) -> str:
    """Flip a byte of the worker's largest pages image at fraction ``at`` of it; its object name."""
    async with s3_server.client() as client:
        prefix = f"{location.prefix}{HASH}/criu/pages-"
        listed = await client.list_objects_v2(Bucket=location.bucket, Prefix=prefix)
        name = str(max(listed["Contents"], key=lambda o: o["Size"])["Key"])
        got = await client.get_object(Bucket=location.bucket, Key=name)
        async with got["Body"] as body:
            data = bytearray(await body.read())
        data[int(len(data) * at)] ^= 0xFF
        await client.put_object(Bucket=location.bucket, Key=name, Body=bytes(data))
    return name


async def test_a_damaged_pages_chunk_never_reaches_the_worker_its_tree_is_stopped(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl, _ = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds))
    await _damage(s3_server, s3_location, 0.5)  # the worker's state: pages it takes lazily
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds), s3_stream_pages=True)
    failed_before = REGISTRY.get_sample_value(*FAILED) or 0.0

    await node.restore("restored", HASH, manifest_digest=digest)
    pid = int((ctl / ".criu-restore.pid").read_text())
    deadline = time.monotonic() + 60
    while await runtime.find("restored") is not None or pid_running(pid):
        assert time.monotonic() < deadline, "the tree that cannot get its pages was not stopped"
        await asyncio.sleep(0.1)
    assert not (ctl / "verify.json").exists(), "the worker finished with memory it cannot have had"
    assert (REGISTRY.get_sample_value(*FAILED) or 0.0) == failed_before + 1
    assert cache.store.list() == []


async def test_a_damaged_chunk_of_what_criu_reads_itself_refuses_the_restore_before_it(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl, _ = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds))
    name = await _damage(s3_server, s3_location, 0.999)  # the last chunk: stacks and libraries' pages
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds), s3_stream_pages=True)

    with pytest.raises(AgentError, match=rf"{name}: chunk [0-9]+ .* does not match its digest"):
        await node.restore("restored", HASH, manifest_digest=digest)
    assert not (ctl / ".criu-restore.pid").exists(), "CRIU ran on pages that were never checked"
    assert await runtime.find("restored") is None
    assert cache.store.list() == []
