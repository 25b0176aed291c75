"""A directory of published artifacts, one per key, and the staging that keeps them whole.

An artifact's key is ``<namespace>/<checkpoint uid>`` for one taken for a Kubernetes DynamoCheckpoint (it
belongs to that namespace and that checkpoint object alone), or its 16-hex identity hash for one taken by
the Kubernetes-free CLI. Layout under ``root``::

    <namespace>/<uid>/           published for a checkpoint: manifest.json + data files, never modified
    <hash>/                      published by the CLI
    .partial-<flat key>-<id>/    a writer's staging directory (same filesystem, so rename is atomic), or
                                 hard links to a staging copy's files a reader uses before it is published
    .partial-<flat key>-<id>.lock    flock()ed by that writer for as long as it lives
    .deleting-<flat key>-<id>/   an artifact being deleted, already invisible to readers

``<flat key>`` is the key with its ``/`` written as ``_`` (neither a namespace, a UID nor a hash holds a
``_``), so staging and deletion stay directly under ``root`` and never look like a namespace.  The only
names ever derived from input are the key's parts, and only after ``validate_artifact_key`` accepted them.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.manifest import (
    IDENTITY_HASH_PATTERN,
    MANIFEST_NAME,
    validate_checkpoint_uid,
    validate_namespace,
)
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.fileio.beneath import components, open_dirs_beneath, opened_dir

__all__ = ["ArtifactStore", "artifact_key", "is_bound_key", "validate_artifact_key"]

PARTIAL_PREFIX = ".partial-"
DELETING_PREFIX = ".deleting-"
LOCK_SUFFIX = ".lock"
_HASH = re.compile(IDENTITY_HASH_PATTERN)


def artifact_key(namespace: str, checkpoint_uid: str) -> str:
    """The store key of the artifact of checkpoint ``checkpoint_uid`` in ``namespace``: ``<ns>/<uid>``;
    ``ValueError`` for a namespace that is no DNS-1123 label or a UID that is no lowercase UUID."""
    return f"{validate_namespace(namespace)}/{validate_checkpoint_uid(checkpoint_uid)}"


def validate_artifact_key(value: object) -> str:
    """``value`` if it is an artifact key, else ``ValueError``: a 16-hex identity hash, or
    ``<namespace>/<checkpoint uid>`` (a DNS-1123 label, one ``/``, a lowercase RFC 4122 UUID).

    The key is the only input that becomes a path in a store, so this is the gate against traversal.
    """
    # fullmatch, not match: "$" would accept a trailing newline.
    if isinstance(value, str) and _HASH.fullmatch(value):
        return value
    if isinstance(value, str) and value.count("/") == 1:
        namespace, uid = value.split("/")
        try:
            return artifact_key(namespace, uid)
        except ValueError as e:
            raise ValueError(f"invalid artifact key {value!r}: {e}") from None
    raise ValueError(
        f"invalid artifact key {value!r}: need an identity hash (16 lowercase hex digits) or "
        "<namespace>/<checkpoint uid>"
    )


def is_bound_key(key: str) -> bool:
    """Whether ``key`` (already validated) is a ``<namespace>/<uid>`` key, not an identity hash."""
    return "/" in key


def _flat(key: str) -> str:
    return key.replace("/", "_")


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


class ArtifactStore:
    """Published artifacts under ``root`` (shared storage or a node-local cache)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, key: str) -> Path:
        """``root/<key>``; ``ValueError("invalid artifact key ...")`` for anything but a key."""
        return self.root / validate_artifact_key(key)

    def exists(self, key: str) -> bool:
        return (self.path_for(key) / MANIFEST_NAME).is_file()

    def open(self, key: str) -> Artifact:
        """The published artifact with its manifest validated (files are checked by ``verify``).

        ``ArtifactError`` when the manifest does not belong under ``key``: for a ``<namespace>/<uid>`` key
        it must be bound to that namespace and checkpoint UID, for a hash key it must be of that identity
        hash and bound to no checkpoint.
        """
        path = self.path_for(key)
        if not (path / MANIFEST_NAME).is_file():
            raise ArtifactNotFoundError(f"no artifact {key} in {self.root}")
        artifact = Artifact.load(path, key)
        binding = artifact.manifest.binding
        if is_bound_key(key):
            if binding is None:
                raise ArtifactError(
                    f"binding mismatch: directory {key} holds an artifact bound to no checkpoint "
                    f"(identity hash {artifact.manifest.identity_hash})"
                )
            if binding.key != key:
                raise ArtifactError(
                    f"binding mismatch: directory {key} holds an artifact bound to {binding.key} "
                    f"(checkpoint {binding.checkpoint_name})"
                )
            return artifact
        if artifact.manifest.identity_hash != key:
            found = artifact.manifest.identity_hash
            raise ArtifactError(f"identity hash mismatch: directory {key} holds a manifest for {found}")
        if binding is not None:
            raise ArtifactError(f"binding mismatch: directory {key} holds an artifact bound to {binding.key}")
        return artifact

    def list(self) -> list[str]:
        """Keys of the published artifacts (both forms), sorted."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        keys = []
        for name in names:
            path = self.root / name
            if _HASH.fullmatch(name) and (path / MANIFEST_NAME).is_file():
                keys.append(name)
                continue
            try:
                validate_namespace(name)
                uids = os.listdir(path)
            except (ValueError, OSError):
                continue  # not a namespace directory (staging, a file, gone meanwhile)
            for uid in uids:
                with contextlib.suppress(ValueError):
                    if (path / validate_checkpoint_uid(uid) / MANIFEST_NAME).is_file():
                        keys.append(f"{name}/{uid}")
        return sorted(keys)

    def delete(self, key: str) -> bool:
        """Remove an artifact; False if there was none.

        It is renamed out of sight first, so no reader ever opens a half-deleted artifact.
        """
        doomed = self.hide(key)
        if doomed is None:
            return False
        shutil.rmtree(doomed)
        return True

    def hide(self, key: str) -> Path | None:
        """The first, instant half of ``delete``: the artifact renamed out of sight (None if there was
        none); the caller removes the returned directory (``gc_partial`` does, should it not)."""
        path = self.path_for(key)
        doomed = self.root / f"{DELETING_PREFIX}{_flat(key)}-{secrets.token_hex(6)}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        if is_bound_key(key):
            # The namespace's last artifact leaves no empty directory behind; a publisher that created
            # it meanwhile creates it again (see ``ArtifactWriter``).
            with contextlib.suppress(OSError):
                os.rmdir(path.parent)
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

    @contextlib.contextmanager
    def linked_copy(self, staged: Artifact, files: Collection[str]) -> Iterator[Artifact]:
        """Hard links of ``files`` of ``staged`` (a writer's staging copy in this store, whose directory is
        about to be renamed) in a staging directory of their own: an unpublished artifact of those files
        whose paths stay while inside, whatever becomes of ``staged``'s directory. Removed on exit (and
        by ``gc_partial`` after a crash). Blocking. ``OSError`` where ``staged`` moved meanwhile."""
        staging = self._stage(staged.key)
        try:
            with opened_dir(staged.path) as src, opened_dir(staging.directory) as dst:
                for rel in files:
                    parts = components(rel)
                    parent = "/".join(parts[:-1])
                    src_parent = open_dirs_beneath(src, parent, create=False) if parent else os.dup(src)
                    try:
                        dst_parent = open_dirs_beneath(dst, parent, create=True) if parent else os.dup(dst)
                        try:
                            os.link(
                                parts[-1],
                                parts[-1],
                                src_dir_fd=src_parent,
                                dst_dir_fd=dst_parent,
                                follow_symlinks=False,
                            )
                        finally:
                            os.close(dst_parent)
                    finally:
                        os.close(src_parent)
            yield Artifact(staging.directory, staged.manifest, staged.key)
        finally:
            shutil.rmtree(staging.directory, ignore_errors=True)
            staging.release()

    def _stage(self, key: str) -> _Staging:
        """A new locked staging directory for ``key`` (used by ``ArtifactWriter``)."""
        validate_artifact_key(key)
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"{PARTIAL_PREFIX}{_flat(key)}-{os.getpid()}-{secrets.token_hex(6)}"
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

    def _parent_for(self, key: str) -> Path:
        """The directory ``key`` is published into, created if needed (used by ``ArtifactWriter``).

        A namespace directory named like an identity hash cannot share the name with a CLI artifact:
        publishing into one that holds an artifact is refused.
        """
        final = self.path_for(key)
        if not is_bound_key(key):
            return final.parent
        if (final.parent / MANIFEST_NAME).exists():
            raise ArtifactError(
                f"cannot publish {key}: {final.parent} is an artifact, not the namespace's directory"
            )
        final.parent.mkdir(exist_ok=True)
        return final.parent
