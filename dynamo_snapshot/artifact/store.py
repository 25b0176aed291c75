"""A directory of published artifacts, one per identity hash, and the staging that keeps them whole.

Layout under ``root``::

    <hash>/                      published: manifest.json + data files, never modified afterwards
    .partial-<hash>-<id>/        a writer's staging directory (same filesystem, so rename is atomic)
    .partial-<hash>-<id>.lock    flock()ed by that writer for as long as it lives
    .deleting-<hash>-<id>/       an artifact being deleted, already invisible to readers

The only name ever derived from input is ``<hash>``, and only after it matched ``^[0-9a-f]{16}$``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.manifest import MANIFEST_NAME, validate_identity_hash
from dynamo_snapshot.artifact.reader import Artifact

__all__ = ["ArtifactStore"]

PARTIAL_PREFIX = ".partial-"
DELETING_PREFIX = ".deleting-"
LOCK_SUFFIX = ".lock"


@dataclass
class _Staging:
    directory: Path
    lock_path: Path
    lock_fd: int

    def release(self) -> None:
        # Unlink before closing: once the lock is free, nothing may find the name and act on it.
        with contextlib.suppress(FileNotFoundError):
            self.lock_path.unlink()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArtifactStore:
    """Published artifacts under ``root`` (shared storage or a node-local cache)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, identity_hash: str) -> Path:
        """``root/<hash>``; ``ValueError("invalid identity hash ...")`` for anything but a hash."""
        return self.root / validate_identity_hash(identity_hash)

    def exists(self, identity_hash: str) -> bool:
        return (self.path_for(identity_hash) / MANIFEST_NAME).is_file()

    def open(self, identity_hash: str) -> Artifact:
        """The published artifact with its manifest validated (files are checked by ``verify``)."""
        path = self.path_for(identity_hash)
        if not (path / MANIFEST_NAME).is_file():
            raise ArtifactNotFoundError(f"no artifact {identity_hash} in {self.root}")
        artifact = Artifact.load(path)
        if artifact.identity_hash != identity_hash:
            raise ArtifactError(
                f"identity hash mismatch: directory {identity_hash} holds a manifest for "
                f"{artifact.identity_hash}"
            )
        return artifact

    def list(self) -> list[str]:
        """Identity hashes of the published artifacts, sorted."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        hashes = []
        for name in names:
            with contextlib.suppress(ValueError):
                if (self.root / validate_identity_hash(name) / MANIFEST_NAME).is_file():
                    hashes.append(name)
        return sorted(hashes)

    def delete(self, identity_hash: str) -> bool:
        """Remove an artifact; False if there was none.

        It is renamed out of sight first, so no reader ever opens a half-deleted artifact.
        """
        doomed = self.hide(identity_hash)
        if doomed is None:
            return False
        shutil.rmtree(doomed)
        return True

    def hide(self, identity_hash: str) -> Path | None:
        """The first, instant half of ``delete``: the artifact renamed out of sight (None if there was
        none); the caller removes the returned directory (``gc_partial`` does, should it not)."""
        path = self.path_for(identity_hash)
        doomed = self.root / f"{DELETING_PREFIX}{identity_hash}-{secrets.token_hex(6)}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        return doomed

    def gc_partial(self) -> builtins.list[Path]:
        """Remove what dead writers and interrupted deletes left behind; the paths removed.

        A staging directory whose writer still holds its lock is left alone, even when that writer
        is another process on another node sharing this store.
        """
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        removed: builtins.list[Path] = []
        for name in names:
            path = self.root / name
            if name.startswith(DELETING_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            elif name.startswith(PARTIAL_PREFIX) and name.endswith(LOCK_SUFFIX):
                staging = path.with_name(name.removesuffix(LOCK_SUFFIX))
                if self._remove_if_abandoned(staging, path):
                    removed.append(staging)
            elif name.startswith(PARTIAL_PREFIX) and self._orphaned(path):
                # Staging without a lock file: a gc died between removing the lock and the directory.
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    @staticmethod
    def _orphaned(staging: Path) -> bool:
        return staging.exists() and not staging.with_name(staging.name + LOCK_SUFFIX).exists()

    def _remove_if_abandoned(self, staging: Path, lock_path: Path) -> bool:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # its writer just finished
        try:
            try:
                if not _try_lock(fd):
                    return False
            except OSError:
                return False  # cannot tell (e.g. no lock service on this NFS mount): keep it
            existed = staging.exists()
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
            return existed
        finally:
            os.close(fd)

    def _stage(self, identity_hash: str) -> _Staging:
        """A new locked staging directory for ``identity_hash`` (used by ``ArtifactWriter``)."""
        validate_identity_hash(identity_hash)
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"{PARTIAL_PREFIX}{identity_hash}-{os.getpid()}-{secrets.token_hex(6)}"
            lock_path = self.root / (name + LOCK_SUFFIX)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A gc may have taken and removed the lock file between our create and flock: then we
            # hold a lock on a deleted file that protects nothing, so start over.
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        staging = _Staging(self.root / name, lock_path, fd)
        try:
            staging.directory.mkdir()
        except BaseException:
            staging.release()
            raise
        return staging
