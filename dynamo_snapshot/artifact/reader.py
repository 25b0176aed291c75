"""A published artifact on disk: its manifest, and checks that its files are the ones it sealed."""

from __future__ import annotations

import asyncio
import functools
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.io import PARALLEL_FILES, IoStats, TreeStats, sha256_file
from dynamo_snapshot.artifact.manifest import (
    MANIFEST_NAME,
    FileEntry,
    GpuInfo,
    Manifest,
    validate_identity_hash,
)

__all__ = ["Artifact"]


@dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: Manifest

    @classmethod
    def load(cls, path: Path) -> Artifact:
        """Read and validate ``path/manifest.json``; ``ArtifactError`` says what is wrong with it."""
        try:
            data = (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError as e:
            raise ArtifactNotFoundError(f"no artifact at {path}: {MANIFEST_NAME} is missing") from e
        return cls(path, Manifest.from_json(data, source=str(path / MANIFEST_NAME)))

    @property
    def identity_hash(self) -> str:
        return self.manifest.identity_hash

    def file_path(self, entry: FileEntry | str) -> Path:
        rel = entry.path if isinstance(entry, FileEntry) else entry
        if rel not in {f.path for f in self.manifest.files}:
            raise KeyError(f"{rel} is not a file of this artifact")
        return self.path / rel

    def compatibility(self, node_gpus: GpuInfo | None) -> list[str]:
        """Reasons a node with ``node_gpus`` cannot restore this checkpoint (empty: it can)."""
        return self.manifest.compatibility(node_gpus)

    def verify(
        self, *, check_checksums: bool = True, expect_hash: str | None = None, parallel: int = PARALLEL_FILES
    ) -> TreeStats:
        """Raise ``ArtifactError`` listing every missing, resized or altered file; else the read stats.

        Sizes are checked for every file before any is hashed, so a truncated file is reported as
        that, and cheaply.  Files not named in the manifest are ignored: CRIU never reads them.
        """
        started = time.monotonic()
        problems: list[str] = []
        if expect_hash is not None and validate_identity_hash(expect_hash) != self.manifest.identity_hash:
            problems.append(
                f"identity hash mismatch: expected {expect_hash}, artifact has {self.manifest.identity_hash}"
            )
        present = [f for f in self.manifest.files if not _size_problem(self.path, f, problems)]
        results: dict[str, IoStats] = {}
        if check_checksums and present:
            with ThreadPoolExecutor(
                max_workers=max(1, parallel), thread_name_prefix="artifact-verify"
            ) as pool:
                digests = {f.path: pool.submit(sha256_file, self.path / f.path) for f in present}
                results = {rel: future.result() for rel, future in digests.items()}
            for f in present:
                got = results[f.path]
                if got.bytes != f.size:
                    problems.append(
                        f"unexpected file size: {f.path} (expected {f.size} bytes, read {got.bytes})"
                    )
                elif got.sha256 != f.sha256:
                    problems.append(f"checksum mismatch: {f.path} (expected {f.sha256}, got {got.sha256})")
        if problems:
            raise ArtifactError(problems)
        return TreeStats(
            bytes=sum(r.bytes for r in results.values()), seconds=time.monotonic() - started, files=results
        )

    async def averify(
        self, *, check_checksums: bool = True, expect_hash: str | None = None, parallel: int = PARALLEL_FILES
    ) -> TreeStats:
        """``verify`` in a worker thread, so the event loop keeps serving."""
        check = functools.partial(
            self.verify, check_checksums=check_checksums, expect_hash=expect_hash, parallel=parallel
        )
        return await asyncio.to_thread(check)


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
