"""Weights put back while they still arrive from the object store (agent --s3-stream-weights, on by
default), against a real SeaweedFS server behind a slow link and real CRIU: a worker whose SDK reads each
byte only once the agent says it is in (its weights manifest's `reads_arriving_weights`) is told to go on
before its weights are whole, reads them as they come, and gets weights-verified once the fetch published
the artifact; what it read is exactly what it saved. A chunk that arrives damaged fails that restore by
name: the worker, already reading, is stopped, never told its weights are verified, and nothing of the
fetch is kept. Off, or for a worker that does not read arriving weights, the restore waits for them."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot.workload import parse_restore_complete
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpointed_to_store, node_with_cache
from tests.conftest import SlowS3
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "test/arriving", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
WEIGHTS = "weights/00-model.dsw"
# Three of the artifact's 64 MiB chunks (a file of one chunk is checked, and read, only whole).
WEIGHTS_MIB = 160
# Slow enough that the weights take over three seconds to come, after the process images.
LINK_BYTES_PER_S = 48e6
READS_ARRIVING = {"WORKER_WAITS_FOR_CHECK": "1", "WORKER_READS_ARRIVING": "1"}


@pytest.fixture
async def slow(slow_s3: SlowS3, s3_location: S3Location) -> AsyncIterator[S3Location]:
    async with slow_s3(s3_location, LINK_BYTES_PER_S) as far:
        yield far


async def _checkpointed(
    tmp: Path, criu_bin: Path, objects: ObjectStore, env: dict[str, str]
) -> tuple[str, Path]:
    env = {"WORKER_WEIGHTS_MIB": str(WEIGHTS_MIB), **env}
    return await checkpointed_to_store(tmp, criu_bin, objects, WORKER, IDENTITY, env)


def _restore_complete(ctl: Path) -> dict[str, object]:
    content = parse_restore_complete((ctl / protocol.FILE_RESTORE_COMPLETE).read_text())
    assert isinstance(content, dict)
    return content


async def test_the_worker_reads_its_weights_while_they_arrive_and_serves_them_whole(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds), READS_ARRIVING)
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds))

    outcome = await node.restore("restored", HASH, manifest_digest=digest)
    try:
        verdict = await await_json(ctl / "verify.json", settle=0.05)
        assert verdict == {"weights_ok": True, "digest_ok": True, "restored": True}
        told = _restore_complete(ctl)
        loaded = json.loads((ctl / "loaded-while-arriving.json").read_text())
    finally:
        await runtime.stop("restored")
    assert told.get(protocol.RESTORE_WEIGHTS_ARRIVING) is True, told
    assert told.get(protocol.RESTORE_WEIGHTS_CHECK) == protocol.WEIGHTS_CHECK_PENDING, told
    size = (await asyncio.to_thread(os.stat, ctl / "weights" / "model.dsw")).st_size
    # The worker began reading with part of the file in (and read all of it: verify.json above).
    assert loaded["first_arrived"] is not None, loaded
    assert loaded["first_arrived"] < size, loaded
    assert loaded["size"] == size, loaded
    arrived = json.loads((ctl / protocol.FILE_WEIGHTS_ARRIVED).read_text())
    assert arrived["files"] == {str(ctl / "weights" / "model.dsw"): size}, arrived
    phases = outcome.timings.phases
    weights_s = WEIGHTS_MIB * (1 << 20) / LINK_BYTES_PER_S
    # Told to go on before the weights were in; the fetch's end awaited after that.
    assert phases["fetch"] + phases["criu_restore"] + phases["signal"] < weights_s, phases
    assert phases["fetch_wait"] > 0, phases
    published = cache.store.open(HASH)
    assert await asyncio.to_thread(os.path.samefile, ctl / "weights" / "model.dsw", published.path / WEIGHTS)
    # The worker could have written into the file it was given while it arrived: the node does not
    # record it as checked, so the next restore checks it again.
    # (Its record is looked up by path: a link changes a file's status time, so ``known`` cannot tell.)
    assert node.verified is not None
    recorded = set(node.verified._seen)
    assert str(published.path / WEIGHTS) not in recorded
    assert str(published.path / "criu" / "inventory.img") in recorded
    assert sorted(os.listdir(cache.root)) == [HASH], "the process images' links were left"


async def test_a_damaged_chunk_fails_the_restore_of_a_worker_already_reading_and_keeps_nothing(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, s3_location: S3Location, slow: S3Location
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds), READS_ARRIVING)
    name = f"s/{HASH}/{WEIGHTS}"
    async with s3_server.client() as client:
        got = await client.get_object(Bucket=s3_location.bucket, Key=name)
        async with got["Body"] as body:
            data = bytearray(await body.read())
        data[len(data) * 3 // 4] ^= 0xFF  # a late chunk: the worker is told to go on before it comes
        await client.put_object(Bucket=s3_location.bucket, Key=name, Body=bytes(data))
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds))

    with pytest.raises(
        AgentError, match=rf"{WEIGHTS}: chunk [0-9]+ \(bytes [0-9-]+\) does not match its digest"
    ):
        await node.restore("restored", HASH, manifest_digest=digest)
    assert (ctl / "reading-while-arriving").exists(), "the worker was not told to go on before the weights"
    pidfile = ctl / ".criu-restore.pid"
    assert not pid_running(int(pidfile.read_text())), "the worker reading damaged weights still runs"
    assert not (ctl / protocol.FILE_WEIGHTS_VERIFIED).exists()
    assert not (ctl / "verify.json").exists()
    assert await runtime.find("restored") is None
    assert cache.store.list() == []
    assert os.listdir(cache.root) == [], "the fetch's staging or the links were left"


@pytest.mark.parametrize(
    ("env", "settings"),
    [(READS_ARRIVING, {"s3_stream_weights": False}), ({"WORKER_WAITS_FOR_CHECK": "1"}, {})],
    ids=["setting-off", "worker-reads-whole-files"],
)
async def test_otherwise_the_worker_is_told_to_go_on_once_its_weights_are_in(
    criu_bin: Path,
    tmp_path: Path,
    s3_server: LocalS3,
    s3_location: S3Location,
    slow: S3Location,
    env: dict[str, str],
    settings: dict[str, bool],
) -> None:
    creds = s3_server.write_credentials(tmp_path / "credentials")
    digest, ctl = await _checkpointed(tmp_path, criu_bin, ObjectStore(s3_location, creds), env)
    node, runtime, _ = node_with_cache(tmp_path, criu_bin, ObjectStore(slow, creds), **settings)

    await node.restore("restored", HASH, manifest_digest=digest)
    try:
        verdict = await await_json(ctl / "verify.json", settle=0.05)
        assert verdict == {"weights_ok": True, "digest_ok": True, "restored": True}
        told = _restore_complete(ctl)
    finally:
        await runtime.stop("restored")
    assert protocol.RESTORE_WEIGHTS_ARRIVING not in told, told
    assert not (ctl / protocol.FILE_WEIGHTS_ARRIVED).exists()
    assert not (ctl / "loaded-while-arriving.json").exists()
