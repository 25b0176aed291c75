"""The agent's side of an S3-compatible object store: every checkpoint is written there once sealed, and a
restore on a node without the artifact fetches it first, every chunk checked against the manifest the
checkpoint recorded, into the node cache (or, with none, the node's own store). The credentials are read
from their directory (a mounted Secret) at each transfer, so a rotated Secret takes effect without a
restart."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from dynamo_snapshot.agent.metrics import OBJECT_STORE_BYTES, OBJECT_STORE_TRANSFERS
from dynamo_snapshot.artifact import Artifact, ArtifactStore
from dynamo_snapshot.artifact.s3 import FetchHooks, ObjectStoreError, S3Artifacts, S3Credentials, S3Location

__all__ = ["ACCESS_KEY_FILE", "SECRET_KEY_FILE", "ObjectStore"]

log = logging.getLogger(__name__)

# The Secret's keys: the names the AWS tools read from the environment, so one Secret serves both.
ACCESS_KEY_FILE = "AWS_ACCESS_KEY_ID"
SECRET_KEY_FILE = "AWS_SECRET_ACCESS_KEY"


class ObjectStore:
    def __init__(self, location: S3Location, credentials_dir: Path) -> None:
        self.location = location
        self.credentials_dir = credentials_dir

    def __str__(self) -> str:
        return f"s3://{self.location.bucket}/{self.location.prefix} at {self.location.endpoint}"

    def _credentials(self) -> S3Credentials:
        # The agent's own mount (a Secret's files are links into its current data): no worker writes here.
        try:
            access = (self.credentials_dir / ACCESS_KEY_FILE).read_text().strip()
            secret = (self.credentials_dir / SECRET_KEY_FILE).read_text().strip()
        except OSError as e:
            raise ObjectStoreError(
                f"the object store's credentials are unreadable: {e.filename}: {e.strerror}"
            ) from None
        if not access or not secret:
            raise ObjectStoreError(f"the object store's credentials in {self.credentials_dir} are empty")
        return S3Credentials(access, secret)

    async def _client(self, key: str) -> S3Artifacts:
        location = self.location.for_key(key)
        return S3Artifacts(location, await asyncio.to_thread(self._credentials))

    async def upload(self, artifact: Artifact) -> int:
        """Write ``artifact`` to the store unless it holds it already; the bytes sent."""
        try:
            async with await self._client(artifact.key) as s3:
                if await s3.exists(artifact.key):
                    OBJECT_STORE_TRANSFERS.labels("upload", "present").inc()
                    return 0
                started = time.monotonic()
                sent = await s3.upload(artifact)
        except ObjectStoreError:
            OBJECT_STORE_TRANSFERS.labels("upload", "failed").inc()
            raise
        OBJECT_STORE_TRANSFERS.labels("upload", "done").inc()
        OBJECT_STORE_BYTES.labels("upload").inc(sent)
        log.info(
            "artifact written to the object store",
            extra={"artifact": artifact.key, "bytes": sent, "s": round(time.monotonic() - started, 3)},
        )
        return sent

    async def fetch(
        self, key: str, manifest_digest: str, store: ArtifactStore, hooks: FetchHooks | None = None
    ) -> Artifact:
        """The artifact ``key`` sealed with ``manifest_digest``, brought into this node's ``store``
        (``hooks``: as ``S3Artifacts.fetch``)."""
        started = time.monotonic()
        try:
            async with await self._client(key) as s3:
                artifact = await s3.fetch(key, manifest_digest, store, hooks)
        except ObjectStoreError:
            OBJECT_STORE_TRANSFERS.labels("fetch", "failed").inc()
            raise
        size = sum(f.size for f in artifact.manifest.files)
        OBJECT_STORE_TRANSFERS.labels("fetch", "done").inc()
        OBJECT_STORE_BYTES.labels("fetch").inc(size)
        log.info(
            "artifact fetched from the object store",
            extra={"artifact": key, "bytes": size, "s": round(time.monotonic() - started, 3)},
        )
        return artifact

    async def delete(self, key: str) -> int:
        """Remove the artifact's objects; how many."""
        async with await self._client(key) as s3:
            return await s3.delete(key)
