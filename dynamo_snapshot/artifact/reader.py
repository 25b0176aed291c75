"""A published artifact on disk: its manifest, and checks that its files are the ones it sealed."""

from __future__ import annotations

import asyncio
import functools
import os
import stat
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.isolated import hash_files_isolated
from dynamo_snapshot.artifact.manifest import (
    MANIFEST_NAME,
    FileEntry,
    GpuInfo,
    Manifest,
    supported_features,
    validate_identity_hash,
)
from dynamo_snapshot.artifact.verified import VerifiedFiles
from dynamo_snapshot.fileio import HASH_PARALLEL, FileDigests, HashJob, TreeStats

__all__ = ["Artifact", "verify_files"]


@dataclass(frozen=True)
class Artifact:
    """A published artifact at ``path``; ``key`` is its store key (by default the one its manifest
    names: ``<namespace>/<checkpoint uid>`` when bound to a checkpoint, else the identity hash)."""

    path: Path
    manifest: Manifest
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.manifest.key)

    @classmethod
    def load(cls, path: Path, key: str | None = None) -> Artifact:
        """Read and validate ``path/manifest.json``; ``ArtifactError`` says what is wrong with it."""
        try:
            data = (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError as e:
            raise ArtifactNotFoundError(f"no artifact at {path}: {MANIFEST_NAME} is missing") from e
        return cls(path, Manifest.from_json(data, source=str(path / MANIFEST_NAME)), key or "")

    @property
    def identity_hash(self) -> str:
        return self.manifest.identity_hash

    def file_path(self, entry: FileEntry | str) -> Path:
        rel = entry.path if isinstance(entry, FileEntry) else entry
        if rel not in {f.path for f in self.manifest.files}:
            raise KeyError(f"{rel} is not a file of this artifact")
        return self.path / rel

    def check_features(self, known: frozenset[str] | None = None) -> None:
        """``ArtifactError`` naming the features this artifact needs that a reader knowing ``known``
        (default: this version's) does not: the first check of a reader, before it reads any file."""
        missing = self.manifest.unsupported_features(known)
        if missing:
            supported = supported_features() if known is None else known
            raise ArtifactError(
                f"it needs format feature(s) this reader does not support: {', '.join(missing)} "
                f"(format_version {self.manifest.format_version}; supported: {', '.join(sorted(supported))})"
            )

    def compatibility(self, node_gpus: GpuInfo | None) -> list[str]:
        """Reasons a node with ``node_gpus`` cannot restore this checkpoint (empty: it can)."""
        return self.manifest.compatibility(node_gpus)

    def verify(
        self,
        *,
        check_checksums: bool = True,
        expect_hash: str | None = None,
        parallel: int = HASH_PARALLEL,
        files: Collection[str] | None = None,
        verified: VerifiedFiles | None = None,
        idle_io: bool = False,
    ) -> TreeStats:
        """Raise ``ArtifactError`` listing every missing, resized or altered file; else the read stats.

        ``files`` limits the check to those relative paths (None: every file of the manifest), e.g. the
        weights a loader is about to read.  Sizes are checked before anything is hashed, so a truncated
        file is reported as that, and cheaply.  Files not named in the manifest are ignored: CRIU never
        reads them.  With ``verified``, files it knows unchanged since they were hashed are not hashed
        again, and the ones hashed now are added to it once all of them passed. ``idle_io`` reads at the
        idle I/O priority, for a check that must not delay other programs' reads.
        """
        started = time.monotonic()
        problems: list[str] = []
        if expect_hash is not None and validate_identity_hash(expect_hash) != self.manifest.identity_hash:
            problems.append(
                f"identity hash mismatch: expected {expect_hash}, artifact has {self.manifest.identity_hash}"
            )
        entries = self._select(files, problems)
        present = check_sizes(self.path, entries, problems)
        if verified is not None:
            present = [f for f in present if not verified.known(self.path, f)]
        stats = (
            hash_entries(self.path, present, problems, parallel=parallel, idle_io=idle_io)
            if check_checksums
            else None
        )
        if problems:
            raise ArtifactError(problems)
        if verified is not None and stats is not None:
            verified.remember(self.path, present)
        if stats is None:
            return TreeStats(bytes=0, seconds=time.monotonic() - started)
        return TreeStats(bytes=stats.bytes, seconds=time.monotonic() - started, files=stats.files)

    async def averify(
        self,
        *,
        check_checksums: bool = True,
        expect_hash: str | None = None,
        parallel: int = HASH_PARALLEL,
        files: Collection[str] | None = None,
        verified: VerifiedFiles | None = None,
        idle_io: bool = False,
    ) -> TreeStats:
        """``verify`` in a worker thread, so the event loop keeps serving."""
        check = functools.partial(
            self.verify,
            check_checksums=check_checksums,
            expect_hash=expect_hash,
            parallel=parallel,
            files=files,
            verified=verified,
            idle_io=idle_io,
        )
        return await asyncio.to_thread(check)

    def _select(self, files: Collection[str] | None, problems: list[str]) -> list[FileEntry]:
        if files is None:
            return list(self.manifest.files)
        known = {f.path for f in self.manifest.files}
        # Asked for by name, so a file the manifest does not seal cannot pass as verified.
        problems += [f"not a file of this artifact: {rel}" for rel in sorted(set(files) - known)]
        return [f for f in self.manifest.files if f.path in files]


def verify_files(root: Path, entries: Sequence[FileEntry], *, parallel: int = HASH_PARALLEL) -> TreeStats:
    """Check that the files ``entries`` seal are under ``root`` intact; ``ArtifactError`` lists every problem.

    For verifying part of an artifact (say its weights) while something else uses the rest: sizes
    first, then every chunk of every file on one pool of ``parallel`` threads.
    """
    problems: list[str] = []
    present = check_sizes(root, entries, problems)
    stats = hash_entries(root, present, problems, parallel=parallel)
    if problems:
        raise ArtifactError(problems)
    return stats


def check_sizes(root: Path, entries: Sequence[FileEntry], problems: list[str]) -> list[FileEntry]:
    """The entries whose file is a regular file of the sealed size; the others go to ``problems``."""
    return [f for f in entries if not _size_problem(root, f, problems)]


def hash_entries(
    root: Path,
    entries: Sequence[FileEntry],
    problems: list[str],
    *,
    parallel: int = HASH_PARALLEL,
    copy_to: Path | None = None,
    direct: bool = False,
    fsync: bool = False,
    idle_io: bool = False,
) -> TreeStats:
    """Hash the files of ``entries`` (copying them under ``copy_to``); mismatches go to ``problems``."""
    started = time.monotonic()
    jobs = [
        HashJob(
            src=root / f.path,
            size=f.size,
            chunk_bytes=f.chunk_bytes if f.chunked else None,
            dst=copy_to / f.path if copy_to is not None else None,
        )
        for f in entries
    ]
    results = hash_files_isolated(jobs, parallel=parallel, direct=direct, fsync=fsync, idle_io=idle_io)
    problems += [p for f, r in zip(entries, results, strict=True) if (p := _digest_problem(f, r)) is not None]
    return TreeStats(
        bytes=sum(r.stats.bytes for r in results),
        seconds=time.monotonic() - started,
        files={f.path: r.stats for f, r in zip(entries, results, strict=True)},
    )


def _digest_problem(entry: FileEntry, got: FileDigests) -> str | None:
    if got.stats.bytes != entry.size:
        return f"unexpected file size: {entry.path} (expected {entry.size} bytes, read {got.stats.bytes})"
    if entry.chunks is None:
        if got.digests[0] != entry.sha256:
            return f"checksum mismatch: {entry.path} (expected {entry.sha256}, got {got.digests[0]})"
        return None
    bad = [i for i, (want, have) in enumerate(zip(entry.chunks, got.digests, strict=True)) if want != have]
    if not bad:
        return None
    # Chunks count from 0; the offset makes that unambiguous for whoever goes looking.
    first = bad[0]
    more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
    offset = first * (entry.chunk_bytes or 0)
    return f"checksum mismatch: {entry.path} (chunk {first} of {len(entry.chunks)} at offset {offset}{more})"


def _size_problem(root: Path, entry: FileEntry, problems: list[str]) -> bool:
    try:
        st = os.lstat(root / entry.path)
    except FileNotFoundError:
        problems.append(f"missing file: {entry.path}")
        return True
    if not stat.S_ISREG(st.st_mode):
        problems.append(f"not a regular file: {entry.path}")
        return True
    if st.st_size != entry.size:
        problems.append(f"unexpected file size: {entry.path} (expected {entry.size} bytes, got {st.st_size})")
        return True
    return False
