"""Sealed artifacts in an S3-compatible object store (any server that speaks S3: SeaweedFS, MinIO, AWS).

An artifact of key ``<namespace>/<uid>`` is one object per file under ``<prefix><namespace>/<uid>/`` (in a
bucket of its namespace's where the bucket's name holds ``{namespace}``), named by the file's path in the
manifest, with ``manifest.json`` written last: a reader that finds the manifest finds every file. Large
files go up as multipart uploads, one part per ``part_bytes``.

Nothing read from the store is trusted: ``fetch`` takes the manifest digest the checkpoint recorded (the
grant's), refuses a manifest that does not have it, and then checks every byte against that manifest as it
arrives: a file sealed in chunks is read as parallel ranged GETs of one chunk each (of parts of one chunk
each, for a file a reader follows from its start), each chunk checked against its digest before it is
written; a file sealed whole is streamed and checked as a whole. Files are
written beneath the store's staging directory's descriptor (no link followed) and published with the
store's own atomic rename once every byte passed. Wrong credentials, a missing or truncated object, a
digest mismatch and a server that stops answering each raise ``ObjectStoreError`` naming the object, and
leave no partial artifact.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.manifest import MANIFEST_NAME, FileEntry, Manifest
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.artifact.store import ArtifactStore, validate_artifact_key
from dynamo_snapshot.artifact.writer import ArtifactWriter
from dynamo_snapshot.fileio import TreeStats
from dynamo_snapshot.fileio.beneath import components, open_dirs_beneath, opened_dir
from dynamo_snapshot.fileio.blocks import pwrite_all

__all__ = ["NAMESPACE_FIELD", "FetchHooks", "ObjectStoreError", "S3Artifacts", "S3Credentials", "S3Location"]

# A store that stops answering: botocore's own errors, the socket's, and aiohttp's (aiobotocore's
# transport), of which a body cut short (ClientPayloadError) is not an OSError.
_TRANSPORT_ERRORS = (TimeoutError, BotoCoreError, OSError, aiohttp.ClientError)

_MIB = 1 << 20
# S3's smallest part of a multipart upload (all but the last).
MIN_PART_BYTES = 5 * _MIB
_MANIFEST_LIMIT = 16 * _MIB
_T = TypeVar("_T")


class ObjectStoreError(ArtifactError):
    """The object store refused or failed a request, or what it returned is not the sealed artifact."""


# Stands for an artifact's namespace in a bucket name: a bucket per namespace.
NAMESPACE_FIELD = "{namespace}"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class S3Location(BaseModel):
    """Where artifacts live: the server, the bucket (one, or one per namespace) and the key prefix. Keys
    are ``<prefix><namespace>/<uid>/``, so tenants can be kept apart by a policy per prefix or per
    bucket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(description="http(s)://host[:port] of the S3 API.", pattern=r"^https?://[^/\s]+/?$")
    bucket: str = Field(
        description="The bucket; `{namespace}` in it stands for the artifact's namespace (a bucket each)."
    )
    prefix: str = Field(default="", description="Key prefix: empty, or ending with '/'.")
    region: str = "us-east-1"
    ca_bundle: Path | None = Field(
        default=None, description="PEM file of the CAs the server's TLS chains to."
    )
    part_bytes: int = Field(default=8 * _MIB, ge=MIN_PART_BYTES, description="Multipart upload part size.")
    parallel: int = Field(default=8, ge=1, le=64, description="Requests in flight per transfer.")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        # A namespace is at least one character: the name with the shortest one must be a bucket's.
        if v.count(NAMESPACE_FIELD) > 1 or not _BUCKET.fullmatch(v.replace(NAMESPACE_FIELD, "n")):
            raise ValueError(
                f"bucket {v!r}: 3-63 lowercase letters, digits, '.' and '-', a letter or digit first and "
                f"last; {NAMESPACE_FIELD} (once) stands for the artifact's namespace"
            )
        return v

    def for_key(self, key: str) -> S3Location:
        """Where artifact ``key`` (``<namespace>/<uid>``) goes: the bucket with its namespace for
        ``{namespace}``. ``ObjectStoreError`` where that is no bucket name, or the key has no namespace."""
        if NAMESPACE_FIELD not in self.bucket:
            return self
        namespace, sep, _ = key.partition("/")
        if not sep:
            raise ObjectStoreError(
                f"artifact {key} has no namespace, and the bucket {self.bucket!r} is one per namespace"
            )
        bucket = self.bucket.replace(NAMESPACE_FIELD, namespace)
        if not _BUCKET.fullmatch(bucket):
            raise ObjectStoreError(
                f"artifact {key}: {bucket!r}, the bucket {self.bucket!r} of namespace {namespace}, is no "
                "bucket name (3-63 characters)"
            )
        return self.model_copy(update={"bucket": bucket})

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v and (not v.endswith("/") or v.startswith("/") or "//" in v or ".." in v.split("/")):
            raise ValueError(
                f"prefix {v!r}: empty, or path segments ending with '/' (no leading '/', no '..')"
            )
        return v


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)


class FetchHooks:
    """What a caller of ``S3Artifacts.fetch`` is asked and told on the way; these defaults do nothing."""

    async def room(self, size: int) -> None:
        """Before anything is written: the artifact's size (a capped store makes way, or refuses)."""

    def first(self, manifest: Manifest) -> Collection[str]:
        """The files to bring before the others."""
        return ()

    def first_done(self, staged: Artifact) -> None:
        """Those files are all in and checked: ``staged`` is the unpublished copy, whose directory is
        renamed once the rest is in (the files' inodes stay)."""

    async def chunk_waves(self, path: str, count: int) -> list[list[int]]:
        """File ``path``'s ``count`` chunks in waves (each chunk in one): a wave is asked for once the one
        before it is in."""
        return [list(range(count))]

    def in_order(self, path: str) -> bool:
        """Whether a reader follows file ``path`` from its start: each of its chunks is then asked for in
        parallel pieces, so its chunks come one after another at the link's rate, not all together."""
        return False

    def chunk_in(self, path: str, offset: int, length: int) -> None:
        """``length`` bytes of file ``path`` from ``offset`` are written and checked (a whole file sealed
        whole: once it is)."""


class S3Artifacts:
    """Upload, fetch, find and delete sealed artifacts in one bucket; an async context manager."""

    def __init__(self, location: S3Location, credentials: S3Credentials) -> None:
        self.location = location
        self._credentials = credentials
        self._exit: contextlib.AsyncExitStack | None = None
        self._client: Any = None

    async def __aenter__(self) -> S3Artifacts:
        loc = self.location
        config = AioConfig(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            read_timeout=30,
            max_pool_connections=loc.parallel * 2,
        )
        stack = contextlib.AsyncExitStack()
        self._client = await stack.enter_async_context(
            get_session().create_client(
                "s3",
                endpoint_url=loc.endpoint.rstrip("/"),
                region_name=loc.region,
                aws_access_key_id=self._credentials.access_key_id,
                aws_secret_access_key=self._credentials.secret_access_key,
                verify=str(loc.ca_bundle) if loc.ca_bundle is not None else True,
                config=config,
            )
        )
        self._exit = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._exit is not None:
            await self._exit.aclose()
        self._exit, self._client = None, None

    def object_name(self, key: str, rel: str) -> str:
        """The object of file ``rel`` of artifact ``key``."""
        validate_artifact_key(key)
        return f"{self.location.prefix}{key}/{'/'.join(components(rel))}"

    # ------------------------------------------------------------------ write
    async def upload(self, artifact: Artifact) -> int:
        """Put every file of the sealed ``artifact``, then its manifest; the bytes sent."""
        key = artifact.key
        gate = asyncio.Semaphore(self.location.parallel)

        sizes: list[int] = []

        async def one(entry: FileEntry) -> None:
            async with gate:
                path = artifact.path / entry.path
                sizes.append(await self._put_file(self.object_name(key, entry.path), path, entry.size))

        await _all(one(e) for e in artifact.manifest.files)
        sent = sum(sizes)
        manifest = await asyncio.to_thread((artifact.path / MANIFEST_NAME).read_bytes)
        await self._call("put", self.object_name(key, MANIFEST_NAME), Body=manifest)
        return sent + len(manifest)

    async def _put_file(self, name: str, path: Path, size: int) -> int:
        part = self.location.part_bytes
        if size <= part:
            data = await asyncio.to_thread(path.read_bytes)
            await self._call("put", name, Body=data)
            return len(data)
        upload = await self._call("create_multipart_upload", name)
        upload_id = upload["UploadId"]
        try:
            parts = []
            f = await asyncio.to_thread(path.open, "rb")
            try:
                for number, offset in enumerate(range(0, size, part), start=1):
                    data = await asyncio.to_thread(_read_at, f.fileno(), offset, min(part, size - offset))
                    done = await self._call(
                        "upload_part", name, UploadId=upload_id, PartNumber=number, Body=data
                    )
                    parts.append({"ETag": done["ETag"], "PartNumber": number})
            finally:
                await asyncio.to_thread(f.close)
            await self._call(
                "complete_multipart_upload", name, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(ObjectStoreError):
                await self._call("abort_multipart_upload", name, UploadId=upload_id)
            raise
        return size

    # ------------------------------------------------------------------ read
    async def exists(self, key: str) -> bool:
        """Whether the artifact is complete in the store (its manifest is there)."""
        try:
            await self._call("head", self.object_name(key, MANIFEST_NAME))
        except ArtifactNotFoundError:
            return False
        return True

    async def fetch(
        self, key: str, manifest_digest: str, store: ArtifactStore, hooks: FetchHooks | None = None
    ) -> Artifact:
        """The artifact ``key`` whose sealed manifest has ``manifest_digest``, put into ``store`` under
        ``key`` (checked byte for byte on the way, published with the store's own atomic rename; a copy
        already there with that manifest is used as it is). ``hooks`` are told its size before anything is
        written, and when the files they name first are all in and checked."""
        hooks = hooks or FetchHooks()
        present = await asyncio.to_thread(_present, store, key, manifest_digest)
        if present is not None:
            return present
        name = self.object_name(key, MANIFEST_NAME)
        raw = await self._get_bytes(name, limit=_MANIFEST_LIMIT)
        manifest = Manifest.from_json(raw, source=f"s3://{self.location.bucket}/{name}")
        if manifest.digest != manifest_digest:
            raise ObjectStoreError(
                f"artifact {key} refused: the store's manifest has digest {manifest.digest}, the checkpoint "
                f"recorded {manifest_digest}"
            )
        await hooks.room(sum(e.size for e in manifest.files))
        first = set(hooks.first(manifest))
        started = time.monotonic()
        with ArtifactWriter(store, manifest.identity_hash, key=key) as writer:
            gate = asyncio.Semaphore(self.location.parallel)
            ahead = [e for e in manifest.files if e.path in first]
            # The process images' other files before the weights: a restore may start on them sooner.
            rest = sorted(
                (e for e in manifest.files if e.path not in first),
                key=lambda e: not e.path.startswith("criu/"),
            )
            # The rest's requests queue once every one of the first files' has its turn: the first files
            # come before the rest, and the link stays full while their last requests finish.
            first_gate = _CountingGate(gate, sum(_requests(e) for e in ahead))
            with opened_dir(writer.directory) as dirfd:
                # Every file at its size before any comes: a reader may link one still arriving.
                await asyncio.to_thread(_create_all, dirfd, manifest.files)

                async def first_files() -> None:
                    await _all(self._fetch_file(key, e, dirfd, first_gate, hooks) for e in ahead)
                    if ahead:
                        hooks.first_done(Artifact(writer.directory, manifest, key))

                async def the_rest() -> None:
                    await first_gate.all_in.wait()
                    await _all(self._fetch_file(key, e, dirfd, gate, hooks) for e in rest)

                await _all([first_files(), the_rest()])
            io = TreeStats(sum(e.size for e in manifest.files), time.monotonic() - started)
            try:
                published = await asyncio.to_thread(writer.seal_fetched, manifest, io, raw)
            except (ArtifactError, OSError) as e:
                raise ObjectStoreError(f"artifact {key} fetched, not published in {store.root}: {e}") from e
        return published.artifact

    async def _fetch_file(
        self,
        key: str,
        entry: FileEntry,
        dirfd: int,
        gate: contextlib.AbstractAsyncContextManager[Any],
        hooks: FetchHooks,
    ) -> None:
        name = self.object_name(key, entry.path)
        fd = _open_created(dirfd, entry.path)
        try:
            if entry.chunks is not None and entry.chunk_bytes is not None:
                step = entry.chunk_bytes

                split = self.location.parallel if hooks.in_order(entry.path) else 1

                async def piece(start: int, length: int) -> bytes:
                    async with gate:
                        return await self._get_bytes(name, start=start, length=length)

                async def chunk(i: int, want: str) -> None:
                    offset = i * step
                    length = min(step, entry.size - offset)
                    each = -(-length // split)
                    end = offset + length
                    data = await _joined([piece(at, min(each, end - at)) for at in range(offset, end, each)])
                    if await _in_thread(_write_checked, os.dup(fd), data, offset, want) != want:
                        span = f"bytes {offset}-{offset + length - 1}"
                        raise ObjectStoreError(f"{name}: chunk {i} ({span}) does not match its digest")
                    hooks.chunk_in(entry.path, offset, length)

                chunks = entry.chunks
                waves = await hooks.chunk_waves(entry.path, len(chunks))
                if sorted(i for wave in waves for i in wave) != list(range(len(chunks))):
                    raise ValueError(f"{entry.path}: chunk waves that do not hold each chunk once: {waves}")
                for wave in waves:
                    await _all(chunk(i, chunks[i]) for i in wave)
            else:
                async with gate:
                    digest = await self._stream_to(name, fd, entry.size)
                if digest != entry.sha256:
                    raise ObjectStoreError(f"{name}: the content does not match its digest")
                hooks.chunk_in(entry.path, 0, entry.size)
        finally:
            os.close(fd)

    async def _stream_to(self, name: str, fd: int, size: int) -> str:
        hasher = hashlib.sha256()
        offset = 0
        async for piece in self._body(name):
            if offset + len(piece) > size:
                raise ObjectStoreError(f"{name}: longer than the manifest's {size} bytes")
            await _in_thread(_write_hashed, os.dup(fd), piece, offset, hasher)
            offset += len(piece)
        if offset != size:
            raise ObjectStoreError(f"{name}: truncated, {offset} of {size} bytes")
        return hasher.hexdigest()

    async def _body(self, name: str) -> AsyncIterator[bytes]:
        answer = await self._call("get", name)
        try:
            async with answer["Body"] as body:
                while piece := await body.read(_MIB):
                    yield piece
        except _TRANSPORT_ERRORS as e:
            raise ObjectStoreError(f"{name}: the read failed midway ({type(e).__name__}: {e})") from e

    async def _get_bytes(
        self, name: str, *, start: int = 0, length: int | None = None, limit: int | None = None
    ) -> bytes:
        extra = {"Range": f"bytes={start}-{start + length - 1}"} if length else {}
        answer = await self._call("get", name, **extra)
        try:
            async with answer["Body"] as body:
                data: bytes = await body.read()
        except _TRANSPORT_ERRORS as e:
            raise ObjectStoreError(f"{name}: the read failed midway ({type(e).__name__}: {e})") from e
        if length is not None and len(data) != length:
            raise ObjectStoreError(f"{name}: truncated, {len(data)} of {length} bytes at offset {start}")
        if limit is not None and len(data) > limit:
            raise ObjectStoreError(f"{name}: larger than {limit} bytes")
        return data

    # ------------------------------------------------------------------ delete
    async def delete(self, key: str) -> int:
        """Remove every object of the artifact, its manifest first (so it is no longer complete); how many."""
        prefix = self.object_name(key, MANIFEST_NAME).rsplit("/", 1)[0] + "/"
        with contextlib.suppress(ArtifactNotFoundError):
            await self._call("delete", self.object_name(key, MANIFEST_NAME))
        removed = 0
        token: dict[str, str] = {}
        while True:
            listing = await self._call("list", prefix, **token)
            names = [{"Key": o["Key"]} for o in listing.get("Contents") or []]
            if names:
                await self._call("delete_objects", "", Delete={"Objects": names, "Quiet": True})
                removed += len(names)
            if not listing.get("IsTruncated"):
                return removed
            token = {"ContinuationToken": listing["NextContinuationToken"]}

    # ------------------------------------------------------------------ requests
    async def _call(self, op: str, name: str, **kwargs: Any) -> Any:
        """One S3 request on object ``name`` (a prefix for "list"), its errors as this module's."""
        bucket = self.location.bucket
        client = self._client
        if client is None:
            raise RuntimeError("S3Artifacts is used outside its async with")
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "put": lambda: client.put_object(Bucket=bucket, Key=name, **kwargs),
            "get": lambda: client.get_object(Bucket=bucket, Key=name, **kwargs),
            "head": lambda: client.head_object(Bucket=bucket, Key=name, **kwargs),
            "delete": lambda: client.delete_object(Bucket=bucket, Key=name, **kwargs),
            "list": lambda: client.list_objects_v2(Bucket=bucket, Prefix=name, **kwargs),
            "delete_objects": lambda: client.delete_objects(Bucket=bucket, **kwargs),
        }
        call = calls.get(op) or (lambda: getattr(client, op)(Bucket=bucket, Key=name, **kwargs))
        try:
            return await call()
        except ClientError as e:
            raise _client_error(e, bucket, name) from None
        except _TRANSPORT_ERRORS as e:
            raise ObjectStoreError(
                f"s3://{bucket}/{name}: the store at {self.location.endpoint} did not answer "
                f"({type(e).__name__}: {e})"
            ) from e


def _client_error(e: ClientError, bucket: str, name: str) -> ArtifactError:
    error = e.response.get("Error") or {}
    code = str(error.get("Code") or "")
    status = int((e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    where = f"s3://{bucket}/{name}"
    if code in ("NoSuchKey", "NotFound", "404") or (status == 404 and code != "NoSuchBucket"):
        return ArtifactNotFoundError(f"{where}: no such object")
    if code == "InvalidRange" or status == 416:
        return ObjectStoreError(f"{where}: truncated: the range asked for is beyond its end")
    if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403") or status == 403:
        return ObjectStoreError(f"{where}: the store refused the credentials ({code or status})")
    return ObjectStoreError(f"{where}: {code or status}: {error.get('Message') or e}")


async def _all(aws: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``aws`` side by side; on the first failure the others are cancelled and waited for (none
    still writes into a staging directory being removed, or through a descriptor being closed), and that
    failure is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            for aw in aws:
                group.create_task(aw)
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None


async def _in_thread(write: Callable[..., _T], own_fd: int, *args: Any) -> _T:
    """``write(own_fd, *args)`` in a thread, which closes ``own_fd`` (a duplicate the caller made for it):
    shielded, so a fetch abandoned meanwhile still has the thread run and close it, and a write still
    running then never lands in a descriptor number reused after the fetch closed its own."""

    def run() -> _T:
        try:
            return write(own_fd, *args)
        finally:
            os.close(own_fd)

    return await asyncio.shield(asyncio.to_thread(run))


def _create_all(dirfd: int, entries: list[FileEntry]) -> None:
    for entry in entries:
        parts = components(entry.path)
        parent = (
            open_dirs_beneath(dirfd, "/".join(parts[:-1]), create=True, mode=0o755)
            if len(parts) > 1
            else os.dup(dirfd)
        )
        try:
            fd = os.open(
                parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=parent
            )
        finally:
            os.close(parent)
        try:
            os.ftruncate(fd, entry.size)
        finally:
            os.close(fd)


def _open_created(dirfd: int, path: str) -> int:
    """The file ``_create_all`` made at ``path``, for writing."""
    parts = components(path)
    parent = open_dirs_beneath(dirfd, "/".join(parts[:-1]), create=False) if len(parts) > 1 else os.dup(dirfd)
    try:
        return os.open(parts[-1], os.O_WRONLY | os.O_NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)


async def _joined(aws: list[Coroutine[Any, Any, bytes]]) -> bytes:
    """The pieces' bytes in order; on the first failure the others are cancelled (as ``_all``)."""
    if len(aws) == 1:
        return await aws[0]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(aw) for aw in aws]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return b"".join(t.result() for t in tasks)


def _requests(entry: FileEntry) -> int:
    """The GETs ``_fetch_file`` makes for ``entry``: one per chunk of a file sealed in chunks, else one."""
    return len(entry.chunks) if entry.chunks is not None and entry.chunk_bytes is not None else 1


class _CountingGate:
    """``gate`` for ``expected`` requests: ``all_in`` is set once every one of them has entered."""

    def __init__(self, gate: asyncio.Semaphore, expected: int) -> None:
        self._gate, self._left = gate, expected
        self.all_in = asyncio.Event()
        if expected <= 0:
            self.all_in.set()

    async def __aenter__(self) -> None:
        await self._gate.acquire()
        self._left -= 1
        if self._left <= 0:
            self.all_in.set()

    async def __aexit__(self, *exc: object) -> None:
        self._gate.release()


def _present(store: ArtifactStore, key: str, manifest_digest: str) -> Artifact | None:
    """The store's copy of ``key`` where it is the one with ``manifest_digest``."""
    try:
        artifact = store.open(key)
    except (ArtifactError, ValueError):
        return None
    return artifact if artifact.manifest.digest == manifest_digest else None


def _write_checked(fd: int, data: bytes, offset: int, want: str) -> str:
    """The digest of ``data`` (hashed off the event loop), written at ``offset`` only where it is ``want``."""
    digest = hashlib.sha256(data).hexdigest()
    if digest == want:
        pwrite_all(fd, data, offset)
    return digest


def _write_hashed(fd: int, data: bytes, offset: int, hasher: Any) -> None:
    hasher.update(data)
    pwrite_all(fd, data, offset)


def _read_at(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ObjectStoreError(f"short read of {length} bytes at {offset}: the file changed while uploaded")
    return data
