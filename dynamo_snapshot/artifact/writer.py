"""Writing an artifact so that readers only ever see a complete one.

Data goes into a locked staging directory inside the store; ``publish`` hashes every file, writes the
manifest last, fsyncs, and renames the directory to ``<hash>`` in one step.  A crash at any point
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

from pydantic import JsonValue

from dynamo_snapshot import __version__
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.errors import ArtifactError
from dynamo_snapshot.artifact.io import PARALLEL_FILES, IoStats, TreeStats, copy_tree, sha256_file
from dynamo_snapshot.artifact.manifest import MANIFEST_NAME, FileEntry, GpuInfo, Manifest
from dynamo_snapshot.artifact.reader import Artifact
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


def _hash_and_sync(path: Path) -> IoStats:
    result = sha256_file(path)
    # CRIU does not fsync its images; the rename must not become durable before the data does.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


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
        parallel: int = PARALLEL_FILES,
    ) -> PublishResult:
        """Hash and seal the staged files, then make them visible as ``store/<hash>`` atomically.

        Runs in a worker thread (hashing reads every byte).  ``timings`` gains a ``"hash"`` entry
        with the seconds spent hashing.
        """
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

        return await asyncio.to_thread(self._hash_and_seal, manifest_for, parallel)

    def _hash_and_seal(
        self, manifest_for: Callable[[list[FileEntry], TreeStats], Manifest], parallel: int
    ) -> PublishResult:
        self._check_open()
        started = time.monotonic()
        rels = _staged_files(self.directory)
        with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="artifact-hash") as pool:
            futures = {rel: pool.submit(_hash_and_sync, self.directory / rel) for rel in rels}
            hashed = {rel: future.result() for rel, future in futures.items()}
        io = TreeStats(sum(r.bytes for r in hashed.values()), time.monotonic() - started, hashed)
        files = [FileEntry(path=rel, size=r.bytes, sha256=r.sha256 or "") for rel, r in hashed.items()]
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


async def fetch(source: Artifact, store: ArtifactStore, *, parallel: int = PARALLEL_FILES) -> PublishResult:
    """Copy ``source`` (e.g. on shared storage) into ``store`` (e.g. a node-local cache).

    Every file is hashed while it is copied and checked against the manifest before the copy is
    published, with the same atomic rename as a fresh artifact.  Already present: nothing is copied.
    Runs in a worker thread.
    """
    return await asyncio.to_thread(_fetch, source, store, parallel)


def _fetch(source: Artifact, store: ArtifactStore, parallel: int) -> PublishResult:
    identity_hash = source.manifest.identity_hash
    if store.exists(identity_hash):
        return PublishResult(store.open(identity_hash), won=False, io=TreeStats(0, 0.0))
    with ArtifactWriter(store, identity_hash) as writer:
        io = copy_tree(
            source.path,
            writer.directory,
            files=[f.path for f in source.manifest.files],
            sha256=True,
            parallel_files=parallel,
        )
        problems = []
        for f in source.manifest.files:
            got = io.files[f.path]
            if got.bytes != f.size:
                problems.append(f"unexpected file size: {f.path} (expected {f.size} bytes, got {got.bytes})")
            elif got.sha256 != f.sha256:
                problems.append(f"checksum mismatch: {f.path} (expected {f.sha256}, got {got.sha256})")
        if problems:
            raise ArtifactError(problems)
        return writer._seal(source.manifest, io)
