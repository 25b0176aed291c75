"""A bucket per namespace (``s3Bucket`` holding ``{namespace}``) against a real SeaweedFS server: each
namespace's artifacts go to, come from and are deleted in its own bucket only; a read from a namespace
whose bucket does not exist, a name that is no bucket's and a key without a namespace are refused by
name."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.artifact import ArtifactStore, Binding
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.artifact.s3 import ObjectStoreError, S3Location
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.artifact.helpers import BINDING, publish, sample_files


def _binding(namespace: str) -> Binding:
    return BINDING.model_copy(update={"namespace": namespace})


async def _sealed(store: ArtifactStore, namespace: str) -> Artifact:
    binding = _binding(namespace)
    await publish(store, sample_files(), binding=binding)
    return store.open(binding.key)


async def _keys(s3_server: LocalS3, bucket: str) -> set[str]:
    async with s3_server.client() as client:
        listed = await client.list_objects_v2(Bucket=bucket)
    return {o["Key"] for o in listed.get("Contents") or []}


async def test_each_namespace_has_its_own_bucket(s3_server: LocalS3, tmp_path: Path) -> None:
    tag = secrets.token_hex(3)
    for team in ("team-a", "team-b"):
        await s3_server.create_bucket(f"ckpt-{tag}-{team}")
    location = S3Location(endpoint=s3_server.endpoint, bucket=f"ckpt-{tag}-{{namespace}}", prefix="p/")
    objects = ObjectStore(location, s3_server.write_credentials(tmp_path / "credentials"))
    store = ArtifactStore(tmp_path / "a")
    a, b = await _sealed(store, "team-a"), await _sealed(store, "team-b")
    await objects.upload(a)
    await objects.upload(b)
    assert {k.split("/")[1] for k in await _keys(s3_server, f"ckpt-{tag}-team-a")} == {"team-a"}
    assert {k.split("/")[1] for k in await _keys(s3_server, f"ckpt-{tag}-team-b")} == {"team-b"}

    assert a.manifest.digest is not None
    fetched = await objects.fetch(a.key, a.manifest.digest, ArtifactStore(tmp_path / "b"))
    assert fetched.manifest == a.manifest

    assert await objects.delete(a.key)
    assert await _keys(s3_server, f"ckpt-{tag}-team-a") == set()
    assert await _keys(s3_server, f"ckpt-{tag}-team-b"), "another namespace's bucket was touched"

    # A namespace nobody made a bucket for (SeaweedFS makes a bucket on the first write, so a read shows it):
    # its restore is refused naming the bucket, nothing is written on the node.
    node = ArtifactStore(tmp_path / "c")
    with pytest.raises(ObjectStoreError, match=rf"s3://ckpt-{tag}-team-c/p/team-c/"):
        await objects.fetch(f"team-c/{BINDING.checkpoint_uid}", "0" * 64, node)
    assert node.list() == []


def test_bucket_names_per_namespace_are_checked() -> None:
    location = S3Location(endpoint="http://127.0.0.1:1", bucket="ckpt-{namespace}")
    assert location.for_key("team-a/0d3c").bucket == "ckpt-team-a"
    assert S3Location(endpoint="http://127.0.0.1:1", bucket="one").for_key("team-a/0d3c").bucket == "one"
    with pytest.raises(ObjectStoreError, match="has no namespace"):
        location.for_key("0123456789abcdef")
    with pytest.raises(ObjectStoreError, match="is no bucket name"):
        location.for_key(f"{'n' * 60}/0d3c")
    for bad in ("ckpt-{namespace}-{namespace}", "Ckpt-{namespace}", "{namespace}", "ckpt_{namespace}"):
        with pytest.raises(ValueError, match="stands for the artifact's namespace"):
            AgentConfig.model_validate(
                {"node_name": "n", "s3_endpoint": "http://127.0.0.1:1", "s3_bucket": bad}
            )
