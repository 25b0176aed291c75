"""Writing an artifact so that readers only ever see a complete one.

Data goes into a locked staging directory inside the store; ``publish`` hashes every file (a large one
in chunks, all chunks of all files on one thread pool), writes the sealed manifest last, fsyncs, and
renames the directory to its key (``<namespace>/<uid>`` or ``<hash>``) in one step.  A crash at any
point leaves only staging that ``ArtifactStore.gc_partial`` removes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import platform
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

from pydantic import JsonValue

from dynamo_snapshot import __version__
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.errors import ArtifactError
from dynamo_snapshot.artifact.isolated import hash_files_isolated
from dynamo_snapshot.artifact.manifest import (
    MANIFEST_NAME,
    Binding,
    FileEntry,
    GpuInfo,
    Manifest,
    supported_features,
    validate_identity_hash,
)
from dynamo_snapshot.artifact.reader import Artifact, check_sizes, hash_entries
from dynamo_snapshot.artifact.store import (
    ArtifactStore,
    is_bound_key,
    validate_artifact_key,
)
from dynamo_snapshot.criu.version import CriuVersion
from dynamo_snapshot.fileio import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    HASH_PARALLEL,
    FileDigests,
    HashJob,
    TreeStats,
    fsync_dir,
)

__all__ = ["ArtifactWriter", "PublishResult", "fetch"]

# Tries at publishing when a delete removes the (empty) namespace directory between its creation and the
# rename into it; each try needs a delete to land in that instant.
_PUBLISH_TRIES = 5


@dataclass(frozen=True)
class PublishResult:
    """The artifact now published under the key, and whether it is ours.

    ``won`` is False when another writer published the same key first (for a ``<namespace>/<uid>``
    key, from the same source pod): ours was discarded and ``artifact`` is theirs.  ``io`` is what
    hashing (or fetching) read.
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
    """Stage an artifact of ``identity_hash`` in ``store`` under ``key`` (default: the hash); write files
    under ``directory``. A ``<namespace>/<uid>`` key needs a ``binding`` to that checkpoint at publish.

    Use as a context manager: leaving it without ``publish()`` (or by an exception) discards the
    staging directory.
    """

    def __init__(self, store: ArtifactStore, identity_hash: str, *, key: str | None = None) -> None:
        self.store = store
        self.identity_hash = validate_identity_hash(identity_hash)
        self.key = validate_artifact_key(key if key is not None else identity_hash)
        if not is_bound_key(self.key) and self.key != identity_hash:
            raise ValueError(f"a hash key names its identity: key {self.key}, identity hash {identity_hash}")
        self._staging = store._stage(self.key)
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
        binding: Binding | None = None,
        features: Collection[str] = (),
    ) -> PublishResult:
        """Hash and seal the staged files, then make them visible as ``store/<key>`` atomically.

        Runs in a worker thread (hashing reads every byte).  Files larger than ``chunk_bytes`` (a
        multiple of 4096) are sealed as one SHA-256 per chunk, so ``parallel`` threads share even a
        single huge file.  ``timings`` gains a ``"hash"`` entry with the seconds spent hashing.  The
        manifest records ``binding`` (required for, and matching, a ``<namespace>/<uid>`` key; none for a
        hash key) and ``features``, the optional formats the staged files use (names of
        ``SUPPORTED_FEATURES``: a writer records only what its own version reads), and is sealed with its
        own digest.
        """
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, not {chunk_bytes}")
        self._check_binding(binding)
        unknown = sorted(set(features) - supported_features())
        if unknown:
            raise ValueError(f"unknown artifact feature(s): {', '.join(unknown)}")
        if identity is not None and compute_identity_hash(identity) != self.identity_hash:
            raise ArtifactError(
                f"identity hash mismatch: writer is for {self.identity_hash}, "
                f"the identity hashes to {compute_identity_hash(identity)}"
            )

        def manifest_for(files: list[FileEntry], io: TreeStats) -> Manifest:
            return Manifest(
                identity_hash=self.identity_hash,
                binding=binding,
                identity=identity,
                created_at=datetime.now(UTC),
                source_node=source_node or platform.node() or "unknown",
                gpus=gpus,
                criu_version=str(criu_version),
                agent_version=agent_version,
                files=files,
                timings={**(timings or {}), "hash": io.seconds},
                extra=extra or {},
                features=sorted(set(features)),
            ).sealed()

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
            raise ArtifactError(f"writer for {self.key} already published or discarded")

    def _check_binding(self, binding: Binding | None) -> None:
        """``ArtifactError`` unless ``binding`` is the one the key calls for."""
        if not is_bound_key(self.key):
            if binding is not None:
                raise ArtifactError(
                    f"binding mismatch: an artifact bound to {binding.key} is published under that key, "
                    f"not under the identity hash {self.key}"
                )
            return
        if binding is None:
            raise ArtifactError(f"binding mismatch: artifact {self.key} needs a binding to that checkpoint")
        if binding.key != self.key:
            raise ArtifactError(
                f"binding mismatch: writer is for {self.key}, the binding is to {binding.key}"
            )

    def seal_fetched(self, manifest: Manifest, io: TreeStats, data: bytes) -> PublishResult:
        """Publish files copied into ``directory`` from elsewhere (an object store) as the artifact the
        sealed ``manifest`` (``data``, its exact bytes) describes; the caller checked every byte against
        it. Blocking. ``ArtifactError`` where another artifact than this one is published under the key."""
        result = self._seal(manifest, io, data)
        if not result.won and result.artifact.manifest.digest != manifest.digest:
            raise ArtifactError(
                f"{self.key} already holds another artifact (manifest digest "
                f"{result.artifact.manifest.digest}, not {manifest.digest})"
            )
        return result

    def _seal(self, manifest: Manifest, io: TreeStats, data: bytes | None = None) -> PublishResult:
        """Write ``manifest`` last (as ``data``, its exact bytes, where given), make everything durable,
        and rename staging into place."""
        self._check_open()
        self._check_binding(manifest.binding)
        manifest_path = self.directory / MANIFEST_NAME
        with manifest_path.open("xb") as f:
            f.write(data if data is not None else manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        for d in {self.directory, *((self.directory / f.path).parent for f in manifest.files)}:
            fsync_dir(d)
        final = self.store.path_for(self.key)
        try:
            self._rename_into_place(final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            self.discard()
            return PublishResult(self._winner(manifest), won=False, io=io)
        self._done = True
        self._staging.release()
        fsync_dir(final.parent)
        if final.parent != self.store.root:
            fsync_dir(self.store.root)
        return PublishResult(Artifact(final, manifest, self.key), won=True, io=io)

    def _rename_into_place(self, final: Path) -> None:
        for attempt in range(_PUBLISH_TRIES):
            self.store._parent_for(self.key)
            try:
                # rename(2) refuses a non-empty target, so of two writers exactly one wins.
                os.rename(self.directory, final)
                return
            except FileNotFoundError:
                # A delete removed the namespace's emptied directory between its creation and now.
                if attempt + 1 == _PUBLISH_TRIES or not self.directory.is_dir():
                    raise

    def _winner(self, ours: Manifest) -> Artifact:
        """The artifact another writer published under our key first; ``ArtifactError`` when it is not
        one we may stand for (taken from another pod, or not an artifact at all)."""
        final = self.store.path_for(self.key)
        if not (final / MANIFEST_NAME).is_file():
            raise ArtifactError(f"cannot publish {self.key}: {final} exists and is not an artifact")
        theirs = self.store.open(self.key)
        mine, other = ours.binding, theirs.manifest.binding
        # open() checked that a bound key holds an artifact bound to it: only the source pod may differ.
        if mine is not None and other is not None and other != mine:
            raise ArtifactError(
                f"artifact {self.key} was already published from pod {other.source_pod} "
                f"({other.source_pod_uid}), not from {mine.source_pod} ({mine.source_pod_uid})"
            )
        return theirs


async def fetch(
    source: Artifact, store: ArtifactStore, *, parallel: int = HASH_PARALLEL, idle_io: bool = False
) -> PublishResult:
    """Copy ``source`` (e.g. on shared storage) into ``store`` (e.g. a node-local cache), under its key.

    Every chunk is hashed as it is copied (all chunks of all files on ``parallel`` threads) and
    checked against the manifest before the copy is published, with the same atomic rename as a fresh
    artifact; on any mismatch nothing is published.  Already present: nothing is copied.  ``idle_io`` reads
    and writes at the idle I/O priority (a background fill beside restores).  Runs in a worker thread.
    """
    return await asyncio.to_thread(_fetch, source, store, parallel, idle_io)


def _fetch(source: Artifact, store: ArtifactStore, parallel: int, idle_io: bool) -> PublishResult:
    key = source.key
    if store.exists(key):
        return PublishResult(store.open(key), won=False, io=TreeStats(0, 0.0))
    # The manifest is copied as it is, byte for byte: its seal covers its content as written, which a
    # manifest written anew from the parsed model need not reproduce (defaults filled in, say).
    data = (source.path / MANIFEST_NAME).read_bytes()
    if Manifest.from_json(data, source=str(source.path / MANIFEST_NAME)) != source.manifest:
        raise ArtifactError(f"{source.path / MANIFEST_NAME} changed since the artifact was opened")
    problems: list[str] = []
    present = check_sizes(source.path, source.manifest.files, problems)
    if problems:
        raise ArtifactError(problems)
    with ArtifactWriter(store, source.manifest.identity_hash, key=key) as writer:
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
        return writer._seal(source.manifest, io, data)
