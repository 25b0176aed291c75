"""A node-local cache in front of a shared artifact store or an object store: restores 2..N of a checkpoint
on a node read the node's own disk instead of the shared filesystem or the network.

The shared store stays the source of truth. A cached copy is used only while the store still publishes
an artifact with the same manifest (for an object store: the manifest digest its checkpoint recorded), so
a checkpoint deleted or taken anew is never restored from a stale copy. A copy gets in only through
``fill`` (from the shared store) or an object store's fetch inside ``admitting``: every byte is checked
against the manifest as it is copied and the copy is published with the same atomic rename as a fresh
artifact, so a damaged file never reaches the cache. The cache holds at most ``max_bytes`` of artifacts
and leaves ``min_free_bytes`` of its filesystem free; room is made by removing the least recently
restored copies, never one a restore is reading. A reader pins the key *before* it looks the copy up
(``pinned``, then ``lookup``), and a copy is removed only by renaming it out of sight under the same lock
that guards the pins, so no copy disappears between a reader finding it and using it. One agent per node
owns the directory, so the pins are kept in memory, and the last use of a copy is its directory's mtime,
so the order survives an agent restart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.manifest import Manifest
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.artifact.store import ArtifactStore
from dynamo_snapshot.artifact.writer import fetch

__all__ = ["ArtifactCache", "CacheFull", "CachedCopy", "artifact_bytes"]

log = logging.getLogger(__name__)


def artifact_bytes(manifest: Manifest) -> int:
    """What a copy of the artifact takes on disk, its manifest aside."""
    return sum(f.size for f in manifest.files)


class CacheFull(ArtifactError):
    """The node cache cannot take a copy: larger than the cache, or the copies in use leave no room."""


@dataclass(frozen=True)
class CachedCopy:
    key: str
    bytes: int
    last_used: float


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int, *, min_free_bytes: int = 0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"cache size must be positive, got {max_bytes} bytes")
        if min_free_bytes < 0:
            raise ValueError(f"free space to keep must not be negative, got {min_free_bytes} bytes")
        self.store = ArtifactStore(root)
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self._pins: collections.Counter[str] = collections.Counter()
        # Copies a restore refused while another restore was reading them: never served again, and
        # replaced by the next fill once nobody reads them.
        self._refused: set[str] = set()
        # Guards the pins and every removal: a copy goes only while nobody holds its pin.
        self._lock = threading.Lock()
        # One fill at a time: two fills making room side by side could each count the other's space free.
        self._filling = asyncio.Lock()
        # Told the keys of the copies each fill removed to make room (the agent counts them).
        self.on_evicted: Callable[[list[str]], None] | None = None

    @property
    def root(self) -> Path:
        return self.store.root

    # ------------------------------------------------------------------ reading
    def lookup(self, source: Artifact) -> Artifact | None:
        """The cached copy of ``source`` (under the same key) if it holds the store's manifest, else None
        (a copy of an older checkpoint, or an unreadable one, is left for ``fill`` to replace). Pin the
        key first."""
        return self._lookup(source.key, lambda manifest: manifest == source.manifest)

    def lookup_sealed(self, key: str, manifest_digest: str) -> Artifact | None:
        """The cached copy under ``key`` if its manifest has ``manifest_digest`` (an object store's
        artifact, of which only the digest its checkpoint recorded is known), else None. Pin the key first."""
        return self._lookup(key, lambda manifest: manifest.digest == manifest_digest)

    def _lookup(self, key: str, current: Callable[[Manifest], bool]) -> Artifact | None:
        if key in self._refused:
            return None
        try:
            cached = self.store.open(key)
        except ArtifactNotFoundError:
            return None
        except (ArtifactError, ValueError) as e:
            log.warning("unreadable cached copy", extra={"key": key, "error": str(e)})
            return None
        if not current(cached.manifest):
            log.info("cached copy is of an older checkpoint", extra={"key": key})
            return None
        with contextlib.suppress(OSError):
            os.utime(cached.path)  # its last use, for eviction
        return cached

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[None]:
        """While inside, the copy under ``key`` is not removed. Cheap: safe on an event loop."""
        with self._lock:
            self._pins[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[key] -= 1
                if not self._pins[key]:
                    del self._pins[key]

    def discard(self, key: str, *, even_pinned: bool = False) -> bool:
        """Remove the copy under ``key``; False if none or pinned (unless ``even_pinned``)."""
        with self._lock:
            if self._pins[key] and not even_pinned:
                return False
            doomed = self.store.hide(key)
            self._refused.discard(key)
        if doomed is None:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def refuse(self, key: str) -> bool:
        """A restore found the copy under ``key`` damaged: remove it, or, while another restore reads
        it, never serve it again and let the next fill replace it. True if removed now."""
        with self._lock:
            self._refused.add(key)
        return self.discard(key)

    def discard_refused(self, key: str) -> bool:
        """Remove the copy under ``key`` where a restore refused it and nobody reads it any more."""
        with self._lock:
            refused = key in self._refused
        return refused and self.discard(key)

    def copies(self) -> list[CachedCopy]:
        """The cached copies, least recently used first."""
        found = []
        for key in self.store.list():
            path = self.store.path_for(key)
            try:
                manifest = Artifact.load(path).manifest
                last_used = os.stat(path).st_mtime
            except (ArtifactError, OSError):
                continue  # being removed, or unreadable: the next fill of it replaces it
            found.append(CachedCopy(key, artifact_bytes(manifest), last_used))
        return sorted(found, key=lambda c: (c.last_used, c.key))

    def used_bytes(self) -> int:
        return sum(c.bytes for c in self.copies())

    # ------------------------------------------------------------------ filling
    def make_room(self, need: int) -> list[str] | None:
        """Remove least recently used, unpinned copies until ``need`` more bytes fit under both limits;
        the keys removed, or None when copies in use leave too little room (then nothing is removed,
        unless a copy got pinned meanwhile: the ones before it are gone)."""
        copies = self.copies()
        used = sum(c.bytes for c in copies)
        free = self._free_bytes()
        doomed: list[str] = []
        for copy in copies:
            if used + need <= self.max_bytes and free - need >= self.min_free_bytes:
                break
            if self._pins[copy.key]:
                continue
            doomed.append(copy.key)
            used -= copy.bytes
            free += copy.bytes
        if used + need > self.max_bytes or free - need < self.min_free_bytes:
            return None
        removed = [k for k in doomed if self.discard(k)]
        return removed if len(removed) == len(doomed) else None

    def _free_bytes(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    @contextlib.asynccontextmanager
    async def admitting(
        self, key: str, *, older_unread: bool = False
    ) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
        """Make way for a copy under ``key`` that comes from elsewhere (a fill, an object store's fetch):
        inside, nothing else is admitted, and the caller awaits the function given with the copy's size
        before it writes anything into ``store``. That removes a copy of an older checkpoint under the key
        and the least recently used others until the size fits; ``CacheFull`` where it cannot.
        ``older_unread``: the key's pins are readers waiting for this copy, none reads an older one (they
        look copies up by the manifest digest they want), so an older copy goes even while pinned."""
        async with self._filling:

            async def room(size: int) -> None:
                await self._make_way(key, size, older_unread)

            yield room

    async def _make_way(self, key: str, size: int, older_unread: bool) -> None:
        if size > self.max_bytes:
            raise CacheFull(
                f"artifact {key} ({size} bytes) is larger than the node cache ({self.max_bytes} bytes)"
            )
        # A copy of an older checkpoint, or an unreadable one, makes way (unless a restore is reading it).
        if await asyncio.to_thread(self.store.exists, key) and not await asyncio.to_thread(
            functools.partial(self.discard, key, even_pinned=older_unread)
        ):
            raise CacheFull(f"an older copy of artifact {key} in the node cache is being read")
        await asyncio.to_thread(self.store.gc_partial)
        evicted = await asyncio.to_thread(self.make_room, size)
        if evicted is None:
            raise CacheFull(
                f"no room for artifact {key} ({size} bytes) in the node cache: the copies restores are "
                f"reading fill it (at most {self.max_bytes} bytes, {self.min_free_bytes} left free)"
            )
        if evicted:
            log.info("evicted from the node cache", extra={"keys": evicted, "for": key})
            if self.on_evicted is not None:
                self.on_evicted(evicted)

    async def fill(self, source: Artifact, *, idle_io: bool = True) -> Artifact | None:
        """Copy ``source`` into the cache (already there: that copy); None when it cannot fit.

        ``ArtifactError`` when the source's files do not match its manifest (nothing is published).
        At idle I/O priority by default: a fill must not slow the restores reading the same disks.
        """
        async with self.admitting(source.key) as room:
            with self.pinned(source.key):
                present = await asyncio.to_thread(self.lookup, source)
            if present is not None:
                return present
            try:
                await room(artifact_bytes(source.manifest))
            except CacheFull as e:
                log.info("not cached", extra={"key": source.key, "reason": str(e)})
                return None
            published = await fetch(source, self.store, idle_io=idle_io)
            return published.artifact
