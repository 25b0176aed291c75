"""Sealed artifacts through a real S3 server (SeaweedFS, built by scripts/test-env.sh): up and back byte for
byte, checked against the manifest the checkpoint recorded, and every bad answer of the store refused with
its reason and no partial artifact left."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dynamo_snapshot.artifact import ArtifactNotFoundError, ArtifactStore
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.artifact.s3 import ObjectStoreError, S3Artifacts, S3Credentials, S3Location
from dynamo_snapshot_dev.localcluster.link import shaped_link
from dynamo_snapshot_dev.localcluster.pki import make_pki
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.artifact.helpers import BINDING, KEY, publish, sample_files

BUCKET = "artifacts"
CHUNK = 1 << 20  # small enough that the pages file is read as several ranged GETs


@pytest.fixture
async def bucket(s3_server: LocalS3) -> S3Location:
    name = await s3_server.new_bucket(BUCKET)
    return S3Location(
        endpoint=s3_server.endpoint, bucket=name, prefix="team-a/", part_bytes=5 << 20, parallel=4
    )


def _creds(s3_server: LocalS3) -> S3Credentials:
    return S3Credentials(s3_server.access_key, s3_server.secret_key)


async def _sealed(tmp_path: Path, files: dict[str, bytes]) -> Artifact:
    store = ArtifactStore(tmp_path / "store")
    await publish(store, files, chunk_bytes=CHUNK, binding=BINDING)
    return store.open(KEY)


async def test_an_artifact_goes_up_and_comes_back_byte_for_byte(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path
) -> None:
    files = {**sample_files(), "big.img": os.urandom(12 << 20)}  # over one part: a multipart upload
    artifact = await _sealed(tmp_path, files)
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        sent = await s3.upload(artifact)
        assert await s3.exists(KEY)
        digest = artifact.manifest.digest
        assert digest is not None
        fetched = await s3.fetch(KEY, digest, _node(tmp_path))
        # Already on the node: the copy there is used, nothing fetched again.
        await s3.delete(KEY)
        assert (await s3.fetch(KEY, digest, _node(tmp_path))).path == fetched.path
    assert sent >= sum(len(d) for d in files.values())
    for rel, data in files.items():
        assert (fetched.path / rel).read_bytes() == data, rel
    fetched.verify()  # the artifact's own checks pass on the copy
    assert s3.object_name(KEY, "cuda/gpu-0.bin") == f"team-a/{KEY}/cuda/gpu-0.bin"


async def test_wrong_credentials_are_refused_by_name(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path
) -> None:
    async with S3Artifacts(bucket, S3Credentials(s3_server.access_key, "not-the-secret")) as s3:
        with pytest.raises(ObjectStoreError, match="refused the credentials"):
            await s3.fetch(KEY, "0" * 64, _node(tmp_path))
    assert _left(tmp_path) == []


async def _uploaded(s3_server: LocalS3, bucket: S3Location, tmp_path: Path) -> tuple[Artifact, str]:
    artifact = await _sealed(tmp_path, sample_files())
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        await s3.upload(artifact)
    assert artifact.manifest.digest is not None
    return artifact, artifact.manifest.digest


async def _replace(s3_server: LocalS3, bucket: S3Location, name: str, data: bytes | None) -> None:
    async with s3_server.client() as client:
        if data is None:
            await client.delete_object(Bucket=bucket.bucket, Key=name)
        else:
            await client.put_object(Bucket=bucket.bucket, Key=name, Body=data)


@pytest.mark.parametrize(
    ("rel", "change", "says"),
    [
        ("pagemap-1.img", "missing", "no such object"),
        ("pagemap-1.img", "truncated", "truncated"),
        ("pagemap-1.img", "flipped", "does not match its digest"),
        ("pages-1.img", "truncated", "truncated"),
        ("pages-1.img", "flipped", "chunk 1 (bytes 1048576-2097151) does not match its digest"),
    ],
)
async def test_a_bad_object_fails_the_fetch_naming_it_and_leaves_nothing(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path, rel: str, change: str, says: str
) -> None:
    artifact, digest = await _uploaded(s3_server, bucket, tmp_path)
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        name = s3.object_name(KEY, rel)
        good = (artifact.path / rel).read_bytes()
        if change == "missing":
            await _replace(s3_server, bucket, name, None)
        elif change == "truncated":
            await _replace(s3_server, bucket, name, good[: len(good) // 2])
        else:
            flipped = bytearray(good)
            flipped[CHUNK + 7 if len(good) > CHUNK + 7 else 7] ^= 0xFF
            await _replace(s3_server, bucket, name, bytes(flipped))
        with pytest.raises((ObjectStoreError, ArtifactNotFoundError), match=re.escape(says)) as failed:
            await s3.fetch(KEY, digest, _node(tmp_path))
    assert name in str(failed.value)
    assert _left(tmp_path) == []


async def test_a_manifest_the_checkpoint_did_not_record_is_refused(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path
) -> None:
    await _uploaded(s3_server, bucket, tmp_path)
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        with pytest.raises(ObjectStoreError, match="the checkpoint recorded " + "a" * 64):
            await s3.fetch(KEY, "a" * 64, _node(tmp_path))
    assert _left(tmp_path) == []


async def test_an_artifact_without_its_manifest_is_not_there(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path
) -> None:
    _, digest = await _uploaded(s3_server, bucket, tmp_path)
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        removed = await s3.delete(KEY)
        assert removed == len(sample_files())
        assert not await s3.exists(KEY)
        with pytest.raises(ArtifactNotFoundError, match="no such object"):
            await s3.fetch(KEY, digest, _node(tmp_path))


async def test_the_server_stopped_midway_fails_the_fetch(tmp_path: Path) -> None:
    with LocalS3(tmp_path / "own-server") as own:
        await own.create_bucket(BUCKET)
        location = S3Location(endpoint=own.endpoint, bucket=BUCKET, part_bytes=5 << 20, parallel=1)
        artifact = await _sealed(tmp_path, {**sample_files(), "big.img": os.urandom(64 << 20)})
        assert artifact.manifest.digest is not None
        async with S3Artifacts(location, S3Credentials(own.access_key, own.secret_key)) as s3:
            await s3.upload(artifact)
            fetching = asyncio.create_task(s3.fetch(KEY, artifact.manifest.digest, _node(tmp_path)))
            while not _arrived(tmp_path, "big.img"):
                assert not fetching.done(), "the fetch ended before any of the big file arrived"
                await asyncio.sleep(0.005)
            own.kill()  # in the middle of the big file's chunks
            with pytest.raises(ObjectStoreError, match=r"did not answer|failed midway"):
                await fetching
    assert _left(tmp_path) == []


async def test_a_body_cut_short_fails_the_fetch(
    s3_server: LocalS3, bucket: S3Location, tmp_path: Path
) -> None:
    artifact = await _sealed(tmp_path, {**sample_files(), "big.img": os.urandom(4 << 20)})
    digest = artifact.manifest.digest
    assert digest is not None
    async with S3Artifacts(bucket, _creds(s3_server)) as s3:
        await s3.upload(artifact)
    upstream = urlsplit(s3_server.endpoint)
    assert upstream.hostname is not None
    assert upstream.port is not None
    # Every answer stops 300 KiB in: the manifest arrives whole, the 1 MiB chunks' bodies do not.
    async with shaped_link(upstream.hostname, upstream.port, cut_after=300 << 10) as hostport:
        cut = bucket.model_copy(update={"endpoint": f"http://{hostport}"})
        async with S3Artifacts(cut, _creds(s3_server)) as s3:
            with pytest.raises(ObjectStoreError, match=r"the read failed midway \(ClientPayloadError"):
                await s3.fetch(KEY, digest, _node(tmp_path))
    assert _left(tmp_path) == []


def _node(root: Path) -> ArtifactStore:
    """The store of the node a fetch brings the artifact to."""
    return ArtifactStore(root / "node")


def _left(root: Path) -> list[str]:
    """What a failed fetch left in the node's store: nothing, staging included."""
    node = root / "node"
    return sorted(p.name for p in node.iterdir()) if node.exists() else []


def _arrived(root: Path, rel: str) -> bool:
    """Whether some bytes of ``rel`` were written into a fetch's staging directory (it is created sparse)."""
    return any(p.stat().st_blocks for p in (root / "node").glob(f".*/{rel}"))


def test_a_location_is_checked() -> None:
    for bad in ({"prefix": "/abs/"}, {"prefix": "no-slash"}, {"prefix": "a/../"}, {"bucket": "Bad_Bucket"}):
        with pytest.raises(ValueError, match=r"prefix|bucket"):
            S3Location.model_validate({"endpoint": "http://127.0.0.1:1", "bucket": "ok-bucket", **bad})
    with pytest.raises(ValueError, match="part_bytes"):
        S3Location(endpoint="http://127.0.0.1:1", bucket="ok-bucket", part_bytes=1 << 20)
    assert "secret" not in repr(S3Credentials("id", "secret"))


async def test_https_is_trusted_through_the_ca_bundle_alone(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", ["127.0.0.1"])
    with LocalS3(tmp_path / "tls-server", tls=pki) as tls:
        await tls.create_bucket(BUCKET)
        artifact = await _sealed(tmp_path, sample_files())
        digest = artifact.manifest.digest
        assert digest is not None
        creds = S3Credentials(tls.access_key, tls.secret_key)
        trusted = S3Location(endpoint=tls.endpoint, bucket=BUCKET, ca_bundle=pki.ca_cert)
        assert trusted.endpoint.startswith("https://")
        async with S3Artifacts(trusted, creds) as s3:
            await s3.upload(artifact)
            fetched = await s3.fetch(KEY, digest, _node(tmp_path))
        fetched.verify()
        # The system's CAs do not know this one: refused, by name.
        async with S3Artifacts(trusted.model_copy(update={"ca_bundle": None}), creds) as s3:
            with pytest.raises(ObjectStoreError, match=r"did not answer .*certificate verify failed"):
                await s3.exists(KEY)
