"""One fetch of an artifact from the object store onto this node, shared by every restore and fetch ahead
that wants it: into the node cache (which makes room first) or, with none, the node's store. The process
images come first: a restore starts on them (verify, the writable layer, CRIU) as soon as they are in and
checked, reading hard links of them that keep their paths while the fetch goes on, and waits for the
published artifact only where it needs the rest (the weights). Every byte was checked against the
manifest as it arrived, so the node's verified-files record is told, and the restore does not hash the
files again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

from dynamo_snapshot.agent.metrics import CACHE_BYTES
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.artifact import Artifact, ArtifactCache, ArtifactStore, Manifest, VerifiedFiles
from dynamo_snapshot.artifact.s3 import FetchHooks
from dynamo_snapshot.criu.page_server import PageIndex, PageServerError
from dynamo_snapshot.criu.sparse import ImageFormatError

__all__ = ["NodeFetch"]

log = logging.getLogger(__name__)


class NodeFetch(FetchHooks):
    def __init__(
        self,
        objects: ObjectStore,
        key: str,
        manifest_digest: str,
        store: ArtifactStore,
        cache: ArtifactCache | None,
        verified: VerifiedFiles | None,
        *,
        first: Callable[[Manifest], Collection[str]],
        streamed: Callable[[Manifest], Collection[str]] = lambda _: (),
    ) -> None:
        self.key = key
        self._objects, self._digest, self._store, self._cache = objects, manifest_digest, store, cache
        self._verified = verified
        self._first, self._streamed = first, streamed
        self._room: Callable[[int], Awaitable[None]] | None = None
        # The unpublished copy once the process images are in; set (or the fetch ended) wakes readers.
        self.staged: Artifact | None = None
        # The store's manifest, once read (by a fetch that brings the files itself).
        self.manifest: Manifest | None = None
        self._first_files: list[str] = []
        # Files a restore may read while they arrive (``streamed``), linked beside the first ones; what
        # of every file is in and checked, by chunk offset, and the chunk size of each file.
        self._streamed_files: list[str] = []
        self._in: dict[str, set[int]] = {}
        self._step: dict[str, int] = {}
        self._size: dict[str, int] = {}
        self._arrived = asyncio.Event()
        self._brought = False
        self._first_in = asyncio.Event()
        # Files linked out to a worker while they arrived (``expose``): what the worker may have written
        # into them since is not the fetch's to vouch for, so the node's verified-files record skips
        # them; once that record is being made, nothing more is exposed.
        self._exposed: set[str] = set()
        self._vouching = False
        self.task: asyncio.Task[Artifact] = asyncio.create_task(self._run(), name=f"fetch-{key}")

    @property
    def target(self) -> ArtifactStore:
        return self._cache.store if self._cache is not None else self._store

    async def _run(self) -> Artifact:
        cache = self._cache
        try:
            if cache is None:
                published = await self._objects.fetch(self.key, self._digest, self._store, self)
            else:
                async with cache.admitting(self.key, older_unread=True) as room:
                    self._room = room
                    published = await self._objects.fetch(self.key, self._digest, cache.store, self)
        finally:
            self._first_in.set()
            if cache is not None:
                CACHE_BYTES.set(await asyncio.to_thread(cache.used_bytes))
        self._vouching = True
        if self._verified is not None and self._brought:
            # Every byte was checked as it came (a copy found on the node instead was not: its files are
            # checked by the restore as any other). Renaming the staging directory into place leaves the
            # files' status unchanged.
            files = [f for f in published.manifest.files if f.path not in self._exposed]
            await asyncio.to_thread(self._verified.remember, published.path, files)
        return published

    # ------------------------------------------------------------------ FetchHooks
    async def room(self, size: int) -> None:
        if self._room is not None:
            await self._room(size)

    def first(self, manifest: Manifest) -> Collection[str]:
        # Asked only of a fetch that brings the files itself.
        self._brought = True
        self.manifest = manifest
        self._first_files = list(self._first(manifest))
        first = set(self._first_files)
        self._streamed_files = [f for f in self._streamed(manifest) if f not in first]
        self._step = {f.path: f.chunk_bytes or max(f.size, 1) for f in manifest.files}
        self._size = {f.path: f.size for f in manifest.files}
        return self._first_files

    def first_done(self, staged: Artifact) -> None:
        self.staged = staged
        self._first_in.set()

    async def chunk_waves(self, path: str, count: int) -> list[list[int]]:
        """A streamed pages image's chunks that hold what a restore reads before CRIU starts (the pages it
        cannot take lazily) come first, on their own: so CRIU starts after those, not after the whole
        image."""
        every = list(range(count))
        if path not in self._streamed_files or not path.startswith("criu/"):
            return [every]
        await self._first_in.wait()
        staged = self.staged
        if staged is None:
            return [every]
        try:
            index = await asyncio.to_thread(PageIndex, staged.path / "criu")
        except (ImageFormatError, PageServerError, OSError, ValueError) as e:
            log.debug("pages' order unknown", extra={"artifact": self.key, "error": str(e)})
            return [every]
        step, name = self._step[path], path.removeprefix("criu/")
        first = {i for n, offset, length in index.eager() if n == name for i in _chunks(offset, length, step)}
        return [sorted(first), [i for i in every if i not in first]]

    def in_order(self, path: str) -> bool:
        # A streamed weights file: the worker reads it from its start as it arrives.
        return path in self._streamed_files and not path.startswith("criu/")

    def chunk_in(self, path: str, offset: int, length: int) -> None:
        self._in.setdefault(path, set()).add(offset)
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    # ------------------------------------------------------------------ ranges
    @property
    def streamed_files(self) -> list[str]:
        return list(self._streamed_files)

    @property
    def streams(self) -> bool:
        """Whether the early copy holds files still arriving, which ``range_in`` tells the parts of."""
        return bool(self._streamed_files) and self.staged is not None and not self.task.done()

    async def range_in(self, path: str, offset: int, length: int) -> None:
        """Returns once bytes ``offset`` to ``offset + length`` of ``path`` are in and checked; raises what
        ended the fetch where it ended without them."""
        while not self._covered(path, offset, length):
            if self.task.done():
                self.task.result()  # the fetch's own error
                if self._covered(path, offset, length):
                    return
                raise ValueError(f"{path}: bytes {offset}-{offset + length} are not in the fetched artifact")
            arrived = asyncio.ensure_future(self._arrived.wait())
            try:
                await asyncio.wait({arrived, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()

    def size(self, path: str) -> int:
        return self._size[path]

    def chunk_bytes(self, path: str) -> int:
        """The size of ``path``'s chunks as ``range_in`` counts them (the whole file where it has none)."""
        return self._step[path]

    def expose(self, path: str) -> bool:
        """Whether ``path``, still arriving, may be linked out to a worker (which may write into it): not
        once the fetch is vouching for its files; if so, the fetch no longer vouches for this one."""
        if self._vouching or self.task.done():
            return False
        self._exposed.add(path)
        return True

    def _covered(self, path: str, offset: int, length: int) -> bool:
        step = self._step.get(path)
        if step is None:
            return False
        got = self._in.get(path, set())
        return all(i * step in got for i in _chunks(offset, length, step))

    # ------------------------------------------------------------------ readers
    @contextlib.asynccontextmanager
    async def early(self) -> AsyncIterator[Artifact | None]:
        """Inside: the process images as an unpublished artifact of links that keep their paths (its
        weights files absent), once they are in and checked; None where the fetch is over by then (or
        ended before them): the caller awaits ``task``."""
        await self._first_in.wait()
        staged = self.staged
        if self.task.done() or staged is None:
            yield None
            return
        target, files = self.target, self._first_files + self._streamed_files
        try:
            links = await asyncio.to_thread(_enter, target.linked_copy(staged, files))
        except OSError as e:
            # The fetch published (or gave up) while the links were made: the caller awaits it.
            log.debug("staged copy moved before it was linked", extra={"artifact": self.key, "error": str(e)})
            yield None
            return
        copy, exit_links = links
        try:
            if self._verified is not None:
                linked = set(self._first_files)
                entries = [f for f in copy.manifest.files if f.path in linked]
                await asyncio.to_thread(self._verified.remember, copy.path, entries)
            yield copy
        finally:
            await asyncio.to_thread(exit_links)


def _chunks(offset: int, length: int, step: int) -> range:
    """The indices of the ``step``-sized chunks bytes ``offset`` to ``offset + length`` lie in."""
    return range(offset // step, (offset + max(length, 1) - 1) // step + 1)


def _enter(cm: contextlib.AbstractContextManager[Artifact]) -> tuple[Artifact, Callable[[], None]]:
    """Enter ``cm`` (in a thread) and return what it gives and how to leave it."""
    stack = contextlib.ExitStack()
    value = stack.enter_context(cm)
    return value, stack.close
