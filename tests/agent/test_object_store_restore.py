"""Checkpoints through an S3-compatible object store (a real SeaweedFS server) with the agent's Executor and
real CRIU: one node checkpoints and writes the artifact to the store, another node with an empty store of
its own fetches it and restores the worker intact; a bad store, bad credentials or a changed object fail
the restore with the reason and leave nothing on the node; a checkpoint the store did not take is said and
written again later; deleting the artifact removes its objects."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.errors import AgentError, ArtifactRefused
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpoint_worker_outcome, local_executor
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "0123456789abcdef"


@pytest.fixture
async def location(s3_server: LocalS3) -> S3Location:
    bucket = await s3_server.new_bucket()
    return S3Location(endpoint=s3_server.endpoint, bucket=bucket, prefix="prod/")


def _objects(root: Path, location: S3Location, s3_server: LocalS3, secret: str | None = None) -> ObjectStore:
    return ObjectStore(location, s3_server.write_credentials(root / "credentials", secret=secret))


def _node(
    root: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location
) -> tuple[Executor, ProcessRuntime]:
    objects = _objects(root, location, s3_server)
    return local_executor(root, criu_bin, compress_pages=False, objects=objects)


def transfers(op: str, result: str) -> float:
    sample = "dynsnap_agent_object_store_transfers_total"
    return REGISTRY.get_sample_value(sample, {"op": op, "result": result}) or 0.0


async def _checkpointed(
    tmp_path: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location
) -> tuple[Executor, str]:
    a, runtime_a = _node(tmp_path / "a", criu_bin, s3_server, location)
    _, outcome = await checkpoint_worker_outcome(a, runtime_a, WORKER, HASH, {"WORKER_STATE_MIB": "24"})
    return a, outcome.manifest_digest


async def test_a_checkpoint_on_one_node_is_restored_on_another(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, location: S3Location
) -> None:
    uploaded, fetched = transfers("upload", "done"), transfers("fetch", "done")
    _, digest = await _checkpointed(tmp_path, criu_bin, s3_server, location)
    assert transfers("upload", "done") == uploaded + 1
    b, runtime_b = _node(tmp_path / "b", criu_bin, s3_server, location)
    assert b.store.list() == []
    outcome = await b.restore("restored", HASH, manifest_digest=digest)
    try:
        verdict = await await_json(outcome.workload.control_dir / "verify.json")
        assert verdict["restored"] is True
        assert verdict["digest_after"] == verdict["digest_before"], "memory changed across the restore"
    finally:
        await runtime_b.stop("restored")
        await asyncio.to_thread(shutil.rmtree, outcome.workload.control_dir, True)
    assert "fetch" in outcome.timings.phases
    assert transfers("fetch", "done") == fetched + 1
    assert b.store.open(HASH).manifest.digest == digest
    # The next restore on that node reads its own copy.
    again = await b.restore("again", HASH, manifest_digest=digest)
    await runtime_b.stop("again")
    assert "fetch" not in again.timings.phases
    assert transfers("fetch", "done") == fetched + 1


async def test_bad_fetches_fail_the_restore_with_the_reason_and_leave_nothing(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, location: S3Location
) -> None:
    a, digest = await _checkpointed(tmp_path, criu_bin, s3_server, location)
    assert a.objects is not None

    def node(name: str, objects: ObjectStore) -> Executor:
        return local_executor(tmp_path / name, criu_bin, compress_pages=False, objects=objects)[0]

    wrong = node("wrong-secret", _objects(tmp_path / "w", location, s3_server, "not-the-secret"))
    with pytest.raises(AgentError, match=r"not fetched from the object store .*refused the credentials"):
        await wrong.restore("r", HASH, manifest_digest=digest)
    assert wrong.store.list() == []

    unreadable = node("no-secret", ObjectStore(location, tmp_path / "nowhere"))
    with pytest.raises(AgentError, match=r"credentials are unreadable: .*nowhere/AWS_ACCESS_KEY_ID"):
        await unreadable.restore("r", HASH, manifest_digest=digest)

    b = node("b", a.objects)
    with pytest.raises(AgentError, match="the checkpoint recorded " + "e" * 64):
        await b.restore("r", HASH, manifest_digest="e" * 64)
    gone = max(a.store.open(HASH).manifest.files, key=lambda f: f.size).path
    async with s3_server.client() as client:
        await client.delete_object(Bucket=location.bucket, Key=f"prod/{HASH}/{gone}")
    with pytest.raises(ArtifactRefused, match=rf"prod/{HASH}/{gone}: no such object"):
        await b.restore("r", HASH, manifest_digest=digest)
    assert b.store.list() == []
    assert [p.name for p in (tmp_path / "b" / "store").iterdir()] == []  # no staging left


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB filesystem (tmpfs) for a node's store."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)


async def test_a_full_node_store_fails_the_restore_by_name_and_keeps_nothing(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, location: S3Location, small_disk: Path
) -> None:
    a, digest = await _checkpointed(tmp_path, criu_bin, s3_server, location)
    assert a.objects is not None
    # An artifact of over 24 MiB into 4: the disk fills up midway.
    node, _ = local_executor(
        small_disk,
        criu_bin,
        compress_pages=False,
        objects=a.objects,
        kind=Executor,
        runtime_kind=ProcessRuntime,
    )
    with pytest.raises(AgentError, match=r"not fetched into .*: No space left on device"):
        await node.restore("r", HASH, manifest_digest=digest)
    assert os.listdir(small_disk / "store") == []


async def test_a_store_that_does_not_answer_fails_the_checkpoint_until_it_is_back(
    criu_bin: Path, tmp_path: Path, s3_server: LocalS3, location: S3Location
) -> None:
    away = location.model_copy(update={"endpoint": "http://127.0.0.1:9"})
    node = _objects(tmp_path, away, s3_server)
    a, runtime = local_executor(
        tmp_path, criu_bin, compress_pages=False, objects=node, kind=Executor, runtime_kind=ProcessRuntime
    )
    with pytest.raises(
        AgentError, match=r"checkpoint taken, but not written to the object store .*did not answer"
    ):
        await checkpoint_worker_outcome(a, runtime, WORKER, HASH, {"WORKER_STATE_MIB": "8"})
    assert a.store.list() == [HASH]  # the node's copy stays
    a.objects = _objects(tmp_path, location, s3_server)
    await a.share(HASH)
    async with s3_server.client() as client:
        listed = await client.list_objects_v2(Bucket=location.bucket, Prefix=f"prod/{HASH}/")
    assert f"prod/{HASH}/manifest.json" in {o["Key"] for o in listed["Contents"]}
    present = transfers("upload", "present")
    await a.share(HASH)  # already there: not sent again
    assert transfers("upload", "present") == present + 1

    assert await a.delete_artifact(HASH)
    async with s3_server.client() as client:
        listed = await client.list_objects_v2(Bucket=location.bucket, Prefix=f"prod/{HASH}/")
    assert not listed.get("Contents")
    assert a.store.list() == []


def test_a_bad_object_store_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"s3: s3Bucket: .*bucket 'Bad_B': 3-63 lowercase"):
        AgentConfig.model_validate(
            {"node_name": "n", "s3_endpoint": "http://127.0.0.1:1", "s3_bucket": "Bad_B"}
        )
    with pytest.raises(ValueError, match=r"s3: s3Prefix: .*no leading '/'"):
        AgentConfig.model_validate(
            {"node_name": "n", "s3_endpoint": "http://127.0.0.1:1", "s3_bucket": "ok-b", "s3_prefix": "/x/"}
        )
