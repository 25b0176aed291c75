"""A restore that starts before its fetch from the object store ends (a real SeaweedFS server behind a
slow link, real CRIU): the process images come first, and CRIU restores the worker from them while its
decoupled weights still arrive; the weights are put back from the published copy in the node cache, and
the worker finds them intact. Weights that arrive damaged fail that restore by name after CRIU brought the
process back: it is stopped before it is told to go on, and nothing of the fetch is kept."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpointed_to_store, node_with_cache
from tests.conftest import SlowS3
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "test/streamed", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
WEIGHTS = "weights/00-model.dsw"
WEIGHTS_MIB = 48
# Slow enough that the weights take over a second to come, after the process images.
LINK_BYTES_PER_S = 24e6


@pytest.fixture
async def slow(slow_s3: SlowS3, s3_location: S3Location) -> AsyncIterator[S3Location]:
    async with slow_s3(s3_location, LINK_BYTES_PER_S) as far:
        yield far


async def _checkpointed(tmp: Path, criu_bin: Path, objects: ObjectStore) -> tuple[str, Path]:
    env = {"WORKER_WAITS_FOR_CHECK": "0", "WORKER_WEIGHTS_MIB": str(WEIGHTS_MIB)}
    return await checkpointed_to_store(tmp, criu_bin, objects, WORKER, IDENTITY, env)


async def test_criu_restores_the_process_while_the_weights_still_arrive(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds))
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds))

    outcome = await node.restore("restored", HASH, manifest_digest=digest)
    try:
        verdict = await await_json(ctl / "verify.json", settle=0.05)
        assert verdict == {"weights_ok": True, "digest_ok": True, "restored": True}
    finally:
        await runtime.stop("restored")
    phases = outcome.timings.phases
    # CRIU ran on the process images; what the weights' arrival still added came after it.
    assert {"fetch", "criu_restore", "fetch_wait"} <= phases.keys(), phases
    weights_s = WEIGHTS_MIB * (1 << 20) / LINK_BYTES_PER_S
    assert phases["fetch"] < weights_s, f"the restore waited for the weights before CRIU: {phases}"
    assert phases["fetch_wait"] > 0, phases
    assert outcome.source == "object-store"
    published = cache.store.open(HASH)
    assert await asyncio.to_thread(os.path.samefile, ctl / "weights" / "model.dsw", published.path / WEIGHTS)
    assert sorted(os.listdir(cache.root)) == [HASH], "the process images' links were left"


async def test_weights_that_arrive_damaged_fail_the_restore_after_criu_and_keep_nothing(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds))
    name = f"s/{HASH}/{WEIGHTS}"
    async with s3_server.client() as client:
        got = await client.get_object(Bucket=s3_location.bucket, Key=name)
        async with got["Body"] as body:
            data = bytearray(await body.read())
        data[len(data) // 2] ^= 0xFF
        await client.put_object(Bucket=s3_location.bucket, Key=name, Body=bytes(data))
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds))

    with pytest.raises(AgentError, match=rf"{WEIGHTS}: the content does not match its digest"):
        await node.restore("restored", HASH, manifest_digest=digest)
    # CRIU had brought the process back before the weights failed: it was stopped, never told to go on.
    pidfile = ctl / ".criu-restore.pid"
    assert pidfile.exists(), "CRIU did not restore the process before the weights were in"
    assert not pid_running(int(pidfile.read_text()))
    assert not (ctl / "restore-complete").exists()
    assert await runtime.find("restored") is None
    assert cache.store.list() == []
    assert os.listdir(cache.root) == [], "the fetch's staging or the links were left"
