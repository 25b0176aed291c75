"""Writing an artifact so that readers only ever see a complete one.

Data goes into a locked staging directory inside the store; ``publish`` hashes every file (a large one
in chunks, all chunks of all files on one thread pool), writes the manifest last, fsyncs, and renames
the directory to ``<hash>`` in one step.  A crash at any point
leaves only staging that ``ArtifactStore.gc_partial`` removes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

from pydantic import JsonValue

from dynamo_snapshot import __version__
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.errors import ArtifactError
from dynamo_snapshot.artifact.io import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    HASH_PARALLEL,
    FileDigests,
    HashJob,
    TreeStats,
)
from dynamo_snapshot.artifact.isolated import hash_files_isolated
from dynamo_snapshot.artifact.manifest import MANIFEST_NAME, FileEntry, GpuInfo, Manifest
from dynamo_snapshot.artifact.reader import Artifact, check_sizes, hash_entries
from dynamo_snapshot.artifact.store import ArtifactStore, fsync_dir
from dynamo_snapshot.criu.version import CriuVersion

__all__ = ["ArtifactWriter", "PublishResult", "fetch"]


@dataclass(frozen=True)
class PublishResult:
    """The artifact now published under the hash, and whether it is ours.

    ``won`` is False when another writer published the same hash first: ours was discarded and
    ``artifact`` is theirs.  ``io`` is what hashing (or fetching) read.
    """

    artifact: Artifact
    won: bool
    io: TreeStats

    @property
    def path(self) -> Path:
        return self.artifact.path

    @property
    def total_bytes(self) -> int:
        return self.artifact.manifest.total_bytes


def _job(path: Path, chunk_bytes: int) -> HashJob:
    size = os.stat(path).st_size
    # One chunk or less gains nothing from chunking: keep the plain whole-file digest.
    return HashJob(path, size, chunk_bytes if size > chunk_bytes else None)


def _entry(rel: str, got: FileDigests) -> FileEntry:
    if got.job.chunk_bytes is None:
        return FileEntry(path=rel, size=got.stats.bytes, sha256=got.digests[0])
    return FileEntry(
        path=rel, size=got.stats.bytes, chunk_bytes=got.job.chunk_bytes, chunks=list(got.digests)
    )


def _staged_files(root: Path) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ArtifactError(f"{path.relative_to(root)} is not a regular file or directory")
        files += [(Path(dirpath) / n).relative_to(root).as_posix() for n in filenames]
    if MANIFEST_NAME in files:
        raise ArtifactError(f"{MANIFEST_NAME} is written by publish(), not by the caller")
    return sorted(files)


class ArtifactWriter:
    """Stage an artifact for ``identity_hash`` in ``store``; write files under ``directory``.

    Use as a context manager: leaving it without ``publish()`` (or by an exception) discards the
    staging directory.
    """

    def __init__(self, store: ArtifactStore, identity_hash: str) -> None:
        self.store = store
        self.identity_hash = identity_hash
        self._staging = store._stage(identity_hash)
        self._done = False

    @property
    def directory(self) -> Path:
        """Where to put the data files (e.g. CRIU's images dir)."""
        return self._staging.directory

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()

    def discard(self) -> None:
        """Discard the staging directory (no-op after ``publish``)."""
        if self._done:
            return
        self._done = True
        shutil.rmtree(self._staging.directory, ignore_errors=True)
        self._staging.release()

    async def publish(
        self,
        *,
        criu_version: CriuVersion | str,
        gpus: GpuInfo | None = None,
        identity: CheckpointIdentity | None = None,
        source_node: str | None = None,
        agent_version: str = __version__,
        timings: dict[str, float] | None = None,
        extra: dict[str, JsonValue] | None = None,
        parallel: int = HASH_PARALLEL,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> PublishResult:
        """Hash and seal the staged files, then make them visible as ``store/<hash>`` atomically.

        Runs in a worker thread (hashing reads every byte).  Files larger than ``chunk_bytes`` (a
        multiple of 4096) are sealed as one SHA-256 per chunk, so ``parallel`` threads share even a
        single huge file.  ``timings`` gains a ``"hash"`` entry with the seconds spent hashing.
        """
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, not {chunk_bytes}")
        if identity is not None and compute_identity_hash(identity) != self.identity_hash:
            raise ArtifactError(
                f"identity hash mismatch: writer is for {self.identity_hash}, "
                f"the identity hashes to {compute_identity_hash(identity)}"
            )

        def manifest_for(files: list[FileEntry], io: TreeStats) -> Manifest:
            return Manifest(
                identity_hash=self.identity_hash,
                identity=identity,
                created_at=datetime.now(UTC),
                source_node=source_node or platform.node() or "unknown",
                gpus=gpus,
                criu_version=str(criu_version),
                agent_version=agent_version,
                files=files,
                timings={**(timings or {}), "hash": io.seconds},
                extra=extra or {},
            )

        return await asyncio.to_thread(self._hash_and_seal, manifest_for, parallel, chunk_bytes)

    def _hash_and_seal(
        self,
        manifest_for: Callable[[list[FileEntry], TreeStats], Manifest],
        parallel: int,
        chunk_bytes: int,
    ) -> PublishResult:
        self._check_open()
        started = time.monotonic()
        rels = _staged_files(self.directory)
        jobs = [_job(self.directory / rel, chunk_bytes) for rel in rels]
        # fsync: CRIU does not fsync its images; the rename must not become durable before the data does.
        hashed = hash_files_isolated(jobs, parallel=parallel, fsync=True)
        changed = [
            f"file changed while hashing: {rel} (was {got.job.size} bytes, read {got.stats.bytes})"
            for rel, got in zip(rels, hashed, strict=True)
            if got.stats.bytes != got.job.size
        ]
        if changed:
            raise ArtifactError(changed)
        io = TreeStats(
            sum(got.stats.bytes for got in hashed),
            time.monotonic() - started,
            {rel: got.stats for rel, got in zip(rels, hashed, strict=True)},
        )
        files = [_entry(rel, got) for rel, got in zip(rels, hashed, strict=True)]
        return self._seal(manifest_for(files, io), io)

    def _check_open(self) -> None:
        if self._done:
            raise ArtifactError(f"writer for {self.identity_hash} already published or discarded")

    def _seal(self, manifest: Manifest, io: TreeStats) -> PublishResult:
        """Write ``manifest`` last, make everything durable, and rename staging into place."""
        self._check_open()
        manifest_path = self.directory / MANIFEST_NAME
        with manifest_path.open("xb") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        for d in {self.directory, *((self.directory / f.path).parent for f in manifest.files)}:
            fsync_dir(d)
        final = self.store.path_for(self.identity_hash)
        try:
            # rename(2) refuses a non-empty target, so of two writers exactly one wins.
            os.rename(self.directory, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            self.discard()
            return PublishResult(Artifact.load(final), won=False, io=io)
        self._done = True
        self._staging.release()
        fsync_dir(self.store.root)
        return PublishResult(Artifact(final, manifest), won=True, io=io)


async def fetch(
    source: Artifact, store: ArtifactStore, *, parallel: int = HASH_PARALLEL, idle_io: bool = False
) -> PublishResult:
    """Copy ``source`` (e.g. on shared storage) into ``store`` (e.g. a node-local cache).

    Every chunk is hashed as it is copied (all chunks of all files on ``parallel`` threads) and
    checked against the manifest before the copy is published, with the same atomic rename as a fresh
    artifact; on any mismatch nothing is published.  Already present: nothing is copied.  ``idle_io`` reads
    and writes at the idle I/O priority (a background fill beside restores).  Runs in a worker thread.
    """
    return await asyncio.to_thread(_fetch, source, store, parallel, idle_io)


def _fetch(source: Artifact, store: ArtifactStore, parallel: int, idle_io: bool) -> PublishResult:
    identity_hash = source.manifest.identity_hash
    if store.exists(identity_hash):
        return PublishResult(store.open(identity_hash), won=False, io=TreeStats(0, 0.0))
    problems: list[str] = []
    present = check_sizes(source.path, source.manifest.files, problems)
    if problems:
        raise ArtifactError(problems)
    with ArtifactWriter(store, identity_hash) as writer:
        # O_DIRECT: a bulk copy must not evict the page cache the node's running workers use.
        io = hash_entries(
            source.path,
            present,
            problems,
            parallel=parallel,
            copy_to=writer.directory,
            direct=True,
            fsync=True,
            idle_io=idle_io,
        )
        if problems:
            raise ArtifactError(problems)
        return writer._seal(source.manifest, io)
