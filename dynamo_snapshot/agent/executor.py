"""The checkpoint and restore procedures on one node, over CUDA, CRIU (through the runtime) and the artifact
store. Kubernetes-free: the watcher turns pods into calls here and results into annotations.

``Executor`` is the entry point: ``checkpoint`` (stages in agent.checkpoint), ``restore`` (stages in
agent.restore; from the node cache's copy where it holds one), ``delete_artifact``. Here is what spans
operations: which artifacts restores are reading (an artifact is deleted only while no restore on this
node reads it) and the copies into the node cache that restores from the store start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any

from dynamo_snapshot.agent.artifact_fetch import NodeFetch
from dynamo_snapshot.agent.artifact_files import fetched_first, streamed_pages, streamed_weights
from dynamo_snapshot.agent.checkpoint import CheckpointOutcome, CheckpointRun, wait_ready
from dynamo_snapshot.agent.errors import AgentError, ArtifactRefused
from dynamo_snapshot.agent.gpu_assignment import assigned_gpus, check_gpu_memory
from dynamo_snapshot.agent.metrics import CACHE_BYTES, CACHE_FILLS, CACHE_RESTORES, FAILURES
from dynamo_snapshot.agent.node import DEFAULT_RESTORE_SCRATCH, Node
from dynamo_snapshot.agent.pages_stream import PagesStream
from dynamo_snapshot.agent.restore import (
    Greeting,
    RestoreOutcome,
    RestoreRun,
    check_ahead,
    check_before_reading,
    check_digest,
    compat_refused,
)
from dynamo_snapshot.agent.runtime.base import Workload
from dynamo_snapshot.agent.timings import Timings
from dynamo_snapshot.agent.weights_arrival import ArrivingWeights
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import (
    Artifact,
    ArtifactCache,
    ArtifactError,
    ArtifactNotFoundError,
    Binding,
    CacheFull,
    GpuInfo,
    Manifest,
    validate_artifact_key,
)
from dynamo_snapshot.artifact.s3 import ObjectStoreError

__all__ = [
    "DEFAULT_RESTORE_SCRATCH",
    "AgentError",
    "ArtifactRefused",
    "CheckpointOutcome",
    "Executor",
    "RestoreOutcome",
    "Timings",
    "assigned_gpus",
]

log = logging.getLogger(__name__)


class Executor(Node):
    """Checkpoints and restores on this node, and deletions of their artifacts."""

    # What carries one restore through its stages (benchmarks substitute variants of it).
    restore_run: type[RestoreRun] = RestoreRun
    # What a fetch from the object store brings before the rest, which a restore starts on.
    fetch_first: Callable[[Manifest], list[str]] = staticmethod(fetched_first)

    # ------------------------------------------------------------------ checkpoint
    async def wait_ready(self, workload: Workload, within: float) -> None:
        """Until the worker says it is safe to checkpoint (either generation's ready file); fails early if
        it dies first."""
        await wait_ready(workload, within)

    async def checkpoint(
        self,
        workload: Workload,
        identity_hash: str,
        identity: CheckpointIdentity | None = None,
        *,
        binding: Binding | None = None,
    ) -> CheckpointOutcome:
        """Checkpoint ``workload`` into the store: under ``<namespace>/<checkpoint uid>`` bound to that
        checkpoint and source pod with a ``binding``, else (CLI) under ``identity_hash``."""
        outcome = await CheckpointRun(self, workload, identity_hash, identity, binding).run()
        await self.share(outcome.key)
        return outcome

    async def share(self, artifact_key: str) -> None:
        """Write the published artifact to the object store, where there is one and it lacks it:
        ``AgentError`` if that fails (the node's copy stays; a later call tries again)."""
        if self.objects is None:
            return
        try:
            artifact = await asyncio.to_thread(self.store.open, artifact_key)
            await self.objects.upload(artifact)
        except (ArtifactError, ValueError) as e:
            FAILURES.labels("checkpoint").inc()
            raise AgentError(
                f"checkpoint taken, but not written to the object store {self.objects}: {e}"
            ) from None

    # ------------------------------------------------------------------ restore
    def check_ahead(self, artifact_key: str, manifest_digest: str | None) -> None:
        """Begin the check of the artifact's process images before a restore that must first wait (for
        the kubelet to run the restore pod's container): the restore joins it, or finds the files verified;
        where the artifact is not on the node yet and the prefetch policy allows, its fetch from the object
        store begins first. Best effort, and the check only where verified files are remembered (else the
        restore would hash them again): whatever fails here fails again, and is reported, in the restore."""
        if (self.verified is None and not self._fetches_ahead) or self.deleting[artifact_key]:
            return
        self._ahead(self._check_ahead(artifact_key, manifest_digest))

    @property
    def _fetches_ahead(self) -> bool:
        """Whether a restore pod bound to this node starts the fetch of an artifact it lacks."""
        return self.objects is not None and self.config.s3.s3_prefetch != "none"

    def fetch_ahead(self, artifact_key: str, manifest_digest: str) -> None:
        """Begin bringing the artifact from the object store into this node's store, before any restore
        of it is asked for here (prefetch policy ``all``); one such fetch at a time. Best effort."""
        if self.objects is None or self.deleting[artifact_key]:
            return
        self._ahead(self._fetch_ahead(artifact_key, manifest_digest))

    def _ahead(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.checks_ahead.add(task)
        task.add_done_callback(self.checks_ahead.discard)

    async def _fetch_ahead(self, artifact_key: str, manifest_digest: str) -> None:
        async with self.fetch_ahead_gate:
            with (
                self._reading(artifact_key),
                contextlib.suppress(AgentError, ArtifactError, OSError, ValueError),
            ):
                await self._on_this_node(artifact_key, manifest_digest, Timings())

    @property
    def _fetches_into_cache(self) -> bool:
        """Whether artifacts fetched from the object store go into the node cache (capped, least recently
        used out first) rather than this node's store."""
        return self.objects is not None and self.cache is not None

    def _fetch(self, artifact_key: str, manifest_digest: str) -> NodeFetch:
        """The fetch of the artifact onto this node under way, or a new one: restores and fetches ahead of
        them share it."""
        objects = self.objects
        assert objects is not None
        fetch = self.fetching.get(artifact_key)
        if fetch is None:
            fetch = NodeFetch(
                objects,
                artifact_key,
                manifest_digest,
                self.store,
                self.cache,
                self.verified,
                first=self._fetch_first,
                streamed=self._fetch_streamed,
            )
            self.fetching[artifact_key] = fetch

            def ended(done: asyncio.Task[Artifact]) -> None:
                if self.fetching.get(artifact_key) is fetch:
                    del self.fetching[artifact_key]
                if not done.cancelled():
                    done.exception()  # every waiter gets it; retrieved here in case every one gave up

            fetch.task.add_done_callback(ended)
        return fetch

    @property
    def streams_pages(self) -> bool:
        """Whether restores of artifacts being fetched start before their memory pages are in."""
        return self.config.s3.s3_stream_pages and self.runtime.streams_pages

    def _fetch_first(self, manifest: Manifest) -> list[str]:
        streamed = set(self._fetch_streamed(manifest))
        return [f for f in self.fetch_first(manifest) if f not in streamed]

    def _fetch_streamed(self, manifest: Manifest) -> list[str]:
        pages = streamed_pages(manifest) if self.streams_pages else []
        return pages + (streamed_weights(manifest) if self.config.s3.s3_stream_weights else [])

    async def _fetched(self, artifact_key: str, manifest_digest: str) -> Artifact:
        """The whole artifact fetched."""
        return await self._whole(self._fetch(artifact_key, manifest_digest))

    async def _whole(self, fetch: NodeFetch) -> Artifact:
        """What ``fetch`` published (shielded: one waiter giving up does not stop it for the others)."""
        with self._fetch_errors(fetch.key):
            return await asyncio.shield(fetch.task)

    @contextlib.contextmanager
    def _reading(self, artifact_key: str) -> Iterator[None]:
        """While inside, a deletion of the artifact waits, and the node cache keeps its copy of it where
        copies fetched from the object store go there."""
        self.reading[artifact_key] += 1
        pin = (
            self.cache.pinned(artifact_key)
            if self._fetches_into_cache and self.cache is not None
            else contextlib.nullcontext()
        )
        try:
            with pin:
                yield
        finally:
            self.reading[artifact_key] -= 1
            if not self.reading[artifact_key]:
                del self.reading[artifact_key]

    async def _check_ahead(self, artifact_key: str, manifest_digest: str | None) -> None:
        with self._reading(artifact_key), contextlib.suppress(AgentError, ArtifactError, OSError, ValueError):
            source, where = await self._on_this_node(
                artifact_key, manifest_digest, Timings(), fetch=self._fetches_ahead
            )
            if self.verified is None:
                return
            check_digest(source, manifest_digest)
            cached = None
            if where == "store" and self.cache is not None and not self._fetches_into_cache:
                with self.cache.pinned(artifact_key):
                    cached = await asyncio.to_thread(self.cache.lookup, source)
            await check_ahead(self, cached or source)

    async def restore(
        self,
        key: str,
        artifact_key: str,
        *,
        identity_info: dict[str, Any] | None = None,
        manifest_digest: str | None = None,
        image_id: str | None = None,
        visible_gpus: tuple[str, ...] | None = None,
        restore_env: Mapping[str, str] | None = None,
        skip_compat: bool = False,
    ) -> RestoreOutcome:
        """Restore the artifact ``artifact_key`` as workload ``key``: from the node cache's copy when it
        holds the store's current one (a refused copy is dropped and the store's used instead), else
        from the store, after which a copy is put into the node cache in the background. With
        ``manifest_digest``, only an artifact whose sealed manifest has exactly that digest is used;
        with ``image_id`` (the image the restore container runs), only one taken from that image; with
        ``visible_gpus`` (the restore container's GPUs), onto those. ``restore_env`` (the restore
        container's environment) fills restore-context.json where the worker's standby left none. An
        artifact that needs a format feature this agent does not know is refused before anything of it
        is read; one this node or container cannot run (``Incompatible``) too, unless ``skip_compat``."""
        if self.deleting[artifact_key]:
            FAILURES.labels("restore").inc()
            raise ArtifactRefused(f"artifact {artifact_key} refused: it is being deleted")
        try:
            with self._reading(artifact_key):
                greeting = Greeting(identity_info or {}, restore_env)
                return await self._restore_reading(
                    key, artifact_key, greeting, manifest_digest, image_id, visible_gpus, skip_compat
                )
        except ArtifactRefused:
            if self._fetches_into_cache and self.cache is not None:
                # Unpinned now: a copy this restore refused goes, unless another restore still reads it.
                await asyncio.to_thread(self.cache.discard_refused, artifact_key)
            raise

    async def _restore_reading(
        self,
        key: str,
        artifact_key: str,
        greeting: Greeting,
        manifest_digest: str | None,
        image_id: str | None,
        visible_gpus: tuple[str, ...] | None,
        skip_compat: bool,
    ) -> RestoreOutcome:
        timings = Timings()
        # The node cache in front of a shared store: a copy it holds is tried first, and filled after.
        shared_cache = self.cache if self.objects is None else None
        try:
            async with self._arriving(artifact_key, manifest_digest, timings) as (artifact, where, whole):
                with timings.phase("restore", "verify"):
                    gpus = check_before_reading(
                        artifact, manifest_digest, image_id, self.gpus, visible_gpus, skip_compat=skip_compat
                    )
                    if self.cuda is not None:
                        try:
                            await check_gpu_memory(artifact.manifest.extra, gpus, artifact.manifest.gpus)
                        except AgentError as e:
                            compat_refused(str(e), skip_compat, artifact.key)
                if shared_cache is not None:
                    cached = await self._restore_from_cache(
                        shared_cache, key, artifact, timings, greeting, manifest_digest, gpus
                    )
                    if cached is not None:
                        return cached
                run = self.restore_run(self, key, artifact, timings, greeting, manifest_digest, gpus)
                run.published = whole
                fetch = self.fetching.get(artifact_key)
                if whole is not None and fetch is not None and fetch.streams:
                    self._streaming(run, fetch)
                # The fetch's failure while the restore waits on the files in it is the restore's.
                streams = run.stream or run.arriving
                with self._fetch_errors(artifact_key) if streams else contextlib.nullcontext():
                    outcome = await self._restore_fetched_or_not(run, where)
        except BaseException:
            FAILURES.labels("restore").inc()
            raise
        if shared_cache is not None:
            CACHE_RESTORES.labels("store").inc()
            self._start_fill(artifact)
        return outcome

    @staticmethod
    def _streaming(run: RestoreRun, fetch: NodeFetch) -> None:
        """``run`` takes the files ``fetch`` streams as they arrive: memory pages, weights."""
        weights = set(streamed_weights(fetch.manifest)) if fetch.manifest is not None else set()
        pages = [f for f in fetch.streamed_files if f not in weights]
        if pages:
            run.stream = PagesStream(fetch, pages)
        if weights:
            run.arriving = ArrivingWeights(fetch, sorted(weights & set(fetch.streamed_files)))

    async def _restore_fetched_or_not(self, run: RestoreRun, where: str) -> RestoreOutcome:
        """``run`` of an artifact ``where`` ``_on_this_node`` found it; a copy of the object store's in the
        node cache that the restore refuses is removed (the next restore fetches it again)."""
        cache = self.cache if self._fetches_into_cache and where != "store" else None
        try:
            outcome = await run.run()
        except ArtifactRefused:
            if cache is not None:
                CACHE_RESTORES.labels("refused").inc()
                await asyncio.to_thread(cache.refuse, run.artifact.key)
            raise
        if cache is None:
            return outcome
        CACHE_RESTORES.labels("cache" if where == "cache" else "store").inc()
        return dataclasses.replace(outcome, source="cache" if where == "cache" else "object-store")

    async def _on_this_node(
        self, artifact_key: str, manifest_digest: str | None, timings: Timings, *, fetch: bool = True
    ) -> tuple[Artifact, str]:
        """The artifact on this node and where it is found: ``store`` (this node's store), ``cache`` (the node
        cache's copy of the object store's), ``fetched`` (from the object store just now, unless not
        ``fetch``: then refused)."""
        here = await self._local(artifact_key, manifest_digest, timings)
        if here is not None:
            return here
        if not fetch or manifest_digest is None:
            raise ArtifactRefused(f"artifact {artifact_key} refused: not on this node")
        with timings.phase("restore", "fetch"):
            return await self._fetched(artifact_key, manifest_digest), "fetched"

    @contextlib.asynccontextmanager
    async def _arriving(
        self, artifact_key: str, manifest_digest: str | None, timings: Timings
    ) -> AsyncIterator[tuple[Artifact, str, Callable[[], Awaitable[Artifact]] | None]]:
        """For a restore, as ``_on_this_node``, but from a fetch its process images as soon as they are in
        and checked (links that keep their paths while inside), with how to await the whole artifact,
        published, for the rest."""
        here = await self._local(artifact_key, manifest_digest, timings)
        if here is not None:
            yield (*here, None)
            return
        assert manifest_digest is not None
        fetch = self._fetch(artifact_key, manifest_digest)
        async with contextlib.AsyncExitStack() as stack:
            with timings.phase("restore", "fetch"):
                early = await stack.enter_async_context(fetch.early())
                whole = await self._whole(fetch) if early is None else None
            if early is None:
                assert whole is not None
                yield whole, "fetched", None
            else:
                yield early, "fetched", functools.partial(self._whole, fetch)

    async def _local(
        self, artifact_key: str, manifest_digest: str | None, timings: Timings
    ) -> tuple[Artifact, str] | None:
        """The artifact in this node's store, or the node cache's copy of the object store's; None where
        neither holds it and the object store can bring it (else refused)."""
        try:
            with timings.phase("restore", "verify"):
                return await asyncio.to_thread(self.store.open, artifact_key), "store"
        except ArtifactNotFoundError as e:
            if self.objects is None or not manifest_digest:
                raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
        except (ArtifactError, ValueError) as e:
            raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
        if self.cache is not None:
            with timings.phase("restore", "verify"):
                cached = await asyncio.to_thread(self.cache.lookup_sealed, artifact_key, manifest_digest)
            if cached is not None:
                return cached, "cache"
        return None

    @contextlib.contextmanager
    def _fetch_errors(self, artifact_key: str) -> Iterator[None]:
        """A fetch's failure as the restore's: the store's or the node's (AgentError), or the artifact's."""
        target = self.cache.root if self.cache is not None else self.store.root
        try:
            yield
        except ObjectStoreError as e:
            raise AgentError(
                f"artifact {artifact_key} not fetched from the object store {self.objects}: {e}"
            ) from None
        except CacheFull as e:
            raise AgentError(f"artifact {artifact_key} not fetched: {e}") from None
        except OSError as e:
            # The node cannot take it (its disk full, say): nothing of the copy is kept.
            raise AgentError(
                f"artifact {artifact_key} not fetched into {target}: {e.strerror or e}"
            ) from None
        except (ArtifactError, ValueError) as e:
            raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None

    async def _restore_from_cache(
        self,
        cache: ArtifactCache,
        key: str,
        source: Artifact,
        timings: Timings,
        greeting: Greeting,
        manifest_digest: str | None,
        gpus: GpuInfo | None,
    ) -> RestoreOutcome | None:
        """From the node cache's copy of ``source``; None where it has none, or its copy was refused
        (the copy is then removed)."""
        artifact_key = source.key
        # Pinned before the lookup: a fill making room cannot take the copy once it was found.
        with cache.pinned(artifact_key):
            with timings.phase("restore", "verify"):
                cached = await asyncio.to_thread(cache.lookup, source)
            if cached is None:
                return None
            try:
                outcome = await self.restore_run(
                    self, key, cached, timings, greeting, manifest_digest, gpus
                ).run()
            except ArtifactRefused as e:
                CACHE_RESTORES.labels("refused").inc()
                log.warning(
                    "node cache's copy refused, restoring from the store",
                    extra={"artifact": artifact_key, "key": key, "error": str(e)},
                )
            else:
                CACHE_RESTORES.labels("cache").inc()
                return dataclasses.replace(outcome, source="cache")
        await asyncio.to_thread(cache.refuse, artifact_key)
        return None

    # ------------------------------------------------------------------ artifacts
    async def delete_artifact(self, artifact_key: str) -> bool:
        """Remove the artifact ``artifact_key`` from the object store, the store and the node cache.
        False, removing nothing, while a restore on this node reads it or the object store cannot be
        reached; True once removed, or when there was none.

        No restore of it starts meanwhile, and a copy into the node cache under way is waited for (it
        cannot be stopped halfway), so no copy outlives the artifact. ``ValueError`` for a bad key.
        """
        validate_artifact_key(artifact_key)
        if self.reading[artifact_key]:
            return False
        self.deleting[artifact_key] += 1
        removed = False
        try:
            filling = self.fills.get(artifact_key)
            if filling is not None:
                await asyncio.wait([filling])
            if self.objects is not None:
                # First: a copy on no node then names objects nobody would remove.
                try:
                    removed = bool(await self.objects.delete(artifact_key))
                except ArtifactError as e:
                    log.warning(
                        "cannot remove the artifact from the object store; trying again later",
                        extra={"artifact": artifact_key, "error": str(e)},
                    )
                    return False
            removed = await asyncio.to_thread(self.store.delete, artifact_key) or removed
            cache = self.cache
            if cache is not None:
                removed = await asyncio.to_thread(cache.discard, artifact_key) or removed
                CACHE_BYTES.set(await asyncio.to_thread(cache.used_bytes))
        finally:
            self.deleting[artifact_key] -= 1
            if not self.deleting[artifact_key]:
                del self.deleting[artifact_key]
        if removed:
            log.info("artifact deleted", extra={"artifact": artifact_key})
        return True

    def published(self, artifact_key: str) -> Artifact | None:
        """The artifact published under ``artifact_key``, or None where there is none or it is unreadable
        (a manifest that fails validation or its seal, or one bound elsewhere). Blocking: call it in a
        thread."""
        try:
            return self.store.open(artifact_key)
        except ArtifactNotFoundError:
            return None
        except (ArtifactError, ValueError) as e:
            log.warning("published artifact unusable", extra={"artifact": artifact_key, "error": str(e)})
            return None

    # ------------------------------------------------------------------ node cache
    def _start_fill(self, artifact: Artifact) -> None:
        """Copy ``artifact`` into the node cache in the background (one copy per checkpoint at a time)."""
        artifact_key = artifact.key
        if self.cache is None or artifact_key in self.fills:
            return
        task = asyncio.create_task(self._fill(self.cache, artifact), name=f"cache-{artifact_key}")
        self.fills[artifact_key] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self.fills.get(artifact_key) is done:
                del self.fills[artifact_key]

        task.add_done_callback(forget)

    async def _fill(self, cache: ArtifactCache, artifact: Artifact) -> None:
        started = time.monotonic()
        try:
            copy = await cache.fill(artifact, idle_io=True)
        except (ArtifactError, OSError, ValueError) as e:
            CACHE_FILLS.labels("failed").inc()
            log.warning(
                "cannot copy the artifact into the node cache",
                extra={"artifact": artifact.key, "error": str(e)},
            )
            return
        CACHE_FILLS.labels("filled" if copy is not None else "no_room").inc()
        CACHE_BYTES.set(await asyncio.to_thread(cache.used_bytes))
        if copy is not None:
            log.info(
                "artifact copied into the node cache",
                extra={"artifact": artifact.key, "s": round(time.monotonic() - started, 3)},
            )

    async def wait_cache_fills(self) -> None:
        """Until the node cache copies started so far are done."""
        await asyncio.gather(*self.fills.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop the node cache copies in progress (an unfinished copy is never published), the checks
        begun ahead of restores and the watches of page streams (their daemons go on without them)."""
        ahead = [*self.checks_ahead, *self.page_streams]
        for task in [*self.fills.values(), *ahead]:
            task.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)
        await self.wait_cache_fills()
