"""One restore on this node, as stages, each registering on one exit stack what undoes it, so a failure
or a cancellation at any stage undoes exactly what was done:

verify (the manifest's digest and weights entries, GPU compatibility and free memory, the process images,
the weights files' sizes and headers; meanwhile the node files are read ahead, the compressed pages
unpacked and, at idle I/O priority, the weights checked) → restore the process (CRIU) → resume it (CUDA
restored onto the assigned GPUs) → hand it over (the weights' verdict, the weights linked back,
`restore-context.json`, `restore-complete`).

Undo, last registered first: the go-ahead withdrawn, the restored workload stopped, the weights check
cancelled, the unpacked pages removed (or their unpacking stopped), the read-ahead waited for. A worker
whose SDK waits for `weights-verified` gets `restore-complete` as soon as its process is back, so it loads
its weights while the check still reads them; any other gets it only after the check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent import restore_complete
from dynamo_snapshot.agent.artifact_files import EARLY_LOAD_KEY, carried_weights, process_files
from dynamo_snapshot.agent.cuda_processes import checkpointed_pids, resume_cuda
from dynamo_snapshot.agent.errors import AgentError, ArtifactRefused, Incompatible
from dynamo_snapshot.agent.gpu_assignment import assigned_gpus, gpu_remap
from dynamo_snapshot.agent.metrics import BYTES, PREFETCH_BYTES, PREFETCH_SKIPPED, THROUGHPUT
from dynamo_snapshot.agent.node import Node
from dynamo_snapshot.agent.page_images import PagesScratch, StagedPages
from dynamo_snapshot.agent.pages_stream import PagesStream
from dynamo_snapshot.agent.prefetch import PREFETCH_FILE, PrefetchStats, prefetch, read_plan, read_whole
from dynamo_snapshot.agent.runtime.base import Workload, WorkloadRuntimeError
from dynamo_snapshot.agent.sentinels import present, write_sentinel
from dynamo_snapshot.agent.timings import Timings
from dynamo_snapshot.agent.weights import (
    CarriedWeights,
    WeightsNotLinked,
    WeightsPlacementError,
    check_carried,
    locate,
    place_weights,
)
from dynamo_snapshot.agent.weights_arrival import ArrivingWeights
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import Artifact, ArtifactError, GpuInfo
from dynamo_snapshot.criu import CriuError
from dynamo_snapshot.fileio import HASH_PARALLEL, TreeStats

log = logging.getLogger(__name__)

__all__ = [
    "Greeting",
    "RestoreOutcome",
    "RestoreRun",
    "check_ahead",
    "check_before_reading",
    "compat_refused",
    "ensure_restore_context",
]


@dataclass
class RestoreOutcome:
    workload: Workload
    timings: Timings
    prefetch: PrefetchStats | None = None
    # Where the artifact was read: "store", "cache" (the node cache's copy), or "object-store" (fetched
    # from it for this restore).
    source: str = "store"


@dataclass(frozen=True)
class Greeting:
    """What a restored worker is told: restore-complete's identity, and restore-context.json's env."""

    identity: dict[str, Any]
    env: Mapping[str, str] | None


def check_before_reading(
    artifact: Artifact,
    manifest_digest: str | None,
    image_id: str | None,
    node_gpus: GpuInfo | None,
    visible_gpus: tuple[str, ...] | None,
    *,
    skip_compat: bool = False,
) -> GpuInfo | None:
    """Refuse, from its manifest alone, an artifact this restore must not read: not the one the
    checkpoint recorded, needing a format feature this agent does not know, or needing more GPUs than
    the restore container was given; and (``Incompatible``, unless ``skip_compat``) one taken from
    another image or on GPUs this node does not have. Returns the GPUs the restore goes onto."""
    check_digest(artifact, manifest_digest)
    try:
        artifact.check_features()
    except ArtifactError as e:
        raise ArtifactRefused(f"artifact {artifact.key} refused: {e}") from None
    gpus = assigned_gpus(node_gpus, visible_gpus, artifact.manifest.gpus)
    problems = [*_image_problems(artifact, image_id)]
    node_problems = artifact.compatibility(node_gpus)
    if node_problems:
        problems.append("incompatible node: " + "; ".join(node_problems))
    if problems:
        compat_refused("; ".join(problems), skip_compat, artifact.key)
    return gpus


def compat_refused(problem: str, skip_compat: bool, artifact_key: str) -> None:
    """``Incompatible`` with ``problem``; where the pod asked to skip the compatibility checks, a warning
    in the log instead."""
    if not skip_compat:
        raise Incompatible(problem)
    log.warning("compatibility check skipped", extra={"artifact": artifact_key, "problem": problem})


def check_digest(artifact: Artifact, expected: str | None) -> None:
    """``ArtifactRefused`` unless the artifact's sealed manifest has the digest the checkpoint recorded."""
    if expected is not None and artifact.manifest.digest != expected:
        raise ArtifactRefused(
            f"artifact {artifact.key} is not the one checkpoint recorded "
            f"(manifest digest {artifact.manifest.digest or 'none'}, expected {expected})"
        )


def _image_problems(artifact: Artifact, image_id: str | None) -> list[str]:
    """The process tree and its writable layer expect the image they were taken from underneath."""
    recorded = artifact.manifest.extra.get("image")
    if image_id and isinstance(recorded, str) and recorded and recorded != image_id:
        return [
            f"image differs: the checkpoint was taken from image {recorded}, this container runs {image_id}"
        ]
    return []


class RestoreRun:
    """One restore of ``artifact`` as workload ``key``; ``run`` goes through the stages."""

    # Threads of the weights check beside CRIU.
    weights_check_parallel = HASH_PARALLEL

    def __init__(
        self,
        node: Node,
        key: str,
        artifact: Artifact,
        timings: Timings,
        greeting: Greeting,
        manifest_digest: str | None,
        gpus: GpuInfo | None,
    ) -> None:
        self.node = node
        self.key = key
        self.artifact = artifact
        self.gpus = gpus  # the GPUs the restore goes onto (check_before_reading)
        self.timings = timings
        self.greeting = greeting
        self.manifest_digest = manifest_digest
        # What the stages start and find.
        self.weights: list[CarriedWeights] = []
        self.prefetching: asyncio.Task[PrefetchStats] | None = None
        self.staging: StagedPages | None = None
        self.weights_check: asyncio.Task[TreeStats] | None = None
        self.placing: asyncio.Task[None] | None = None
        self.process_stats = TreeStats(0, 0.0)
        self.verified_bytes = 0
        # Where ``artifact`` holds the process images of a fetch still under way: the whole artifact,
        # published, which the weights are read from once it is in.
        self.published: Callable[[], Awaitable[Artifact]] | None = None
        self._whole: Artifact | None = None
        # Its memory pages still arriving: CRIU restores on them as they come (agent/pages_stream.py).
        self.stream: PagesStream | None = None
        # Its weights still arriving, for a worker that reads them as they come (agent/weights_arrival.py).
        self.arriving: ArrivingWeights | None = None

    @property
    def with_weights(self) -> Artifact:
        """The artifact the weights are read from."""
        return self._whole or self.artifact

    @property
    def weight_files(self) -> list[str]:
        return sorted({w.file for w in self.weights})

    async def run(self) -> RestoreOutcome:
        async with contextlib.AsyncExitStack() as undo:
            with self.timings.phase("restore", "verify"):
                await self.verify(undo)
            # The weights are checked while CRIU restores the process: the same read fills the page
            # cache the worker loads them from. Still being fetched: once they are in (hand_over).
            if self.weights and self.weights_check is None and not self._weights_arriving:
                self.start_weights_check(undo)
            if not self._weights_arriving:
                await self.start_placing_weights(undo)
            workload = await self.restore_process(undo)
            await self.resume_process(workload)
            await self.hand_over(workload, undo)
            undo.pop_all()  # the restored worker runs on
        if self.stream is not None:
            self.stream.watch(self.node.runtime, self.key, self.node.page_streams)
        BYTES.labels("restore").inc(self.verified_bytes)
        if self.process_stats.seconds > 0:
            THROUGHPUT.labels("restore").set(self.process_stats.bytes / self.process_stats.seconds / 1e9)
        return RestoreOutcome(workload, self.timings, await _prefetch_result(self.prefetching))

    # ------------------------------------------------------------------ verify
    async def verify(self, undo: contextlib.AsyncExitStack) -> None:
        """Everything CRIU acts on checked before it starts; the read-ahead, the unpacking of compressed
        pages and (at idle I/O priority) the weights check begin meanwhile."""
        self.check_manifest()
        await self.read_tools()
        self.prefetching = await self.start_prefetch()
        if self.prefetching is not None:
            # Its thread ends on its own: just collect it.
            undo.push_async_callback(_collect_quietly, self.prefetching)
        # Compressed pages are unpacked (into a directory of this restore's own) while they are checked;
        # CRIU starts on them only once the check passed.
        settings = self.node.config.restore
        scratch = PagesScratch(settings.restore_scratch, self.node.pages_threads, self.node.scratch_cleaned)
        runtime, key = self.node.runtime, self.key
        self.staging = scratch.start(
            self.artifact, lambda: runtime.control_dir(key).parent / ".restore-images", key, self.timings
        )
        if self.staging is not None:
            undo.push_async_callback(self.staging.discard)
        if self.weights and settings.weights_check_idle_io and not self._weights_arriving:
            # Where the disk's scheduler honours idle I/O priority the weights check takes only the disk
            # time nobody else wants, so it can start now, beside the check of what CRIU needs.
            self.start_weights_check(undo)
        await self.verify_process_images()
        if not self._weights_arriving:
            await self.verify_weights_files()

    @property
    def _weights_arriving(self) -> bool:
        return bool(self.weights) and self.published is not None and self._whole is None

    async def weights_fetched(self, undo: contextlib.AsyncExitStack) -> None:
        """The rest of a fetch under way in, published: its weights files checked as before CRIU (the
        bytes were checked as they arrived) and their check begun."""
        assert self.published is not None
        with self.timings.phase("restore", "fetch_wait"):
            self._whole = await self.published()
        await self.verify_weights_files()
        if self.weights_check is None and self.arriving is None:
            self.start_weights_check(undo)

    def check_manifest(self) -> None:
        # The store's artifact passed this already; the node cache's copy is held to it too.
        check_digest(self.artifact, self.manifest_digest)
        self.weights = carried_weights(self.artifact)

    async def read_tools(self) -> None:
        """CRIU's (and the runtime's) own files into the page cache before the bulk reads begin."""
        if not self.node.config.checkpoint.prefetch_node_files:
            return
        try:
            files = [*await self.node.criu.files(), *self.node.runtime.tool_files()]
        except (CriuError, OSError) as e:
            log.warning("cannot list CRIU's files to read ahead", extra={"error": str(e)})
            return
        stats = await asyncio.to_thread(read_whole, files)
        log.debug("tools read ahead", extra={"files": stats.files, "bytes": stats.bytes, "s": stats.seconds})

    async def start_prefetch(self) -> asyncio.Task[PrefetchStats] | None:
        """Start reading the node files the checkpoint's plan names; None without a (valid) plan."""
        artifact = self.artifact
        if not self.node.config.checkpoint.prefetch_node_files or not any(
            f.path == PREFETCH_FILE for f in artifact.manifest.files
        ):
            return None
        try:
            await artifact.averify(files=[PREFETCH_FILE], verified=self.node.verified)
            plan = await asyncio.to_thread(read_plan, artifact.file_path(PREFETCH_FILE))
        except (ArtifactError, ValueError, OSError) as e:
            # Only a hint: the full check below refuses the artifact if the plan was tampered with.
            log.warning("prefetch plan unusable", extra={"error": str(e)})
            return None
        return asyncio.create_task(asyncio.to_thread(prefetch, plan))

    def start_weights_check(self, undo: contextlib.AsyncExitStack) -> None:
        self.weights_check = asyncio.create_task(self.verify_weights(self.weight_files))
        undo.push_async_callback(_cancel, self.weights_check)

    def process_files(self) -> list[str]:
        """The artifact's files CRIU acts on: all but the weights (and pages still arriving, each chunk
        of which the fetch checks before CRIU can read it)."""
        streamed = set(self.stream.files) if self.stream is not None else set()
        return [f for f in process_files(self.artifact, self.weights) if f not in streamed]

    async def verify_process_images(self) -> None:
        """The process images CRIU acts on, before it starts (the memory pages, most of the bytes,
        included)."""
        await self.verify_files(self.process_files())

    async def verify_files(self, files: list[str]) -> None:
        artifact = self.artifact
        try:
            check, own = check_process_images(self.node, artifact, files)
            stats = await asyncio.shield(check)
            self.process_stats = stats if own else TreeStats(0, 0.0)
            self.verified_bytes = self.process_stats.bytes
        except (ArtifactError, ValueError) as e:
            raise ArtifactRefused(f"artifact {artifact.key} refused: {e}") from None

    async def verify_weights_files(self) -> None:
        """The weights files' sizes and headers; their bytes are checked beside CRIU."""
        artifact = self.with_weights
        try:
            await artifact.averify(files=self.weight_files, check_checksums=False)
            for w in self.weights:
                await asyncio.to_thread(check_carried, artifact.path / w.file, w)
        except (ArtifactError, ValueError, WeightsPlacementError) as e:
            raise ArtifactRefused(f"weights of artifact {self.artifact.key} refused: {e}") from None

    async def verify_weights(self, files: list[str]) -> TreeStats:
        # Timed apart from the phases it overlaps; "weights_wait" is what it added to the restore.
        started = time.monotonic()
        # Linking the weights into a worker's control dir changes their status-change time, so the
        # verified-files cache rarely spares this check: restores under way at once share it instead.
        artifact = self.with_weights
        check, own = self.node.shared_check(
            artifact.path,
            files,
            lambda: artifact.averify(
                files=files,
                verified=self.node.verified,
                idle_io=self.node.config.restore.weights_check_idle_io,
                parallel=self.weights_check_parallel,
            ),
        )
        try:
            stats = await asyncio.shield(check)
        except (ArtifactError, ValueError) as e:
            raise ArtifactRefused(f"weights of artifact {self.artifact.key} refused: {e}") from None
        finally:
            self.timings.overlapped["weights_verify"] = round(time.monotonic() - started, 4)
        return stats if own else TreeStats(0, 0.0)

    async def start_placing_weights(self, undo: contextlib.AsyncExitStack) -> None:
        """Where the target exists before CRIU (a restore pod's container, its control dir on the kubelet's
        mount), its weights are copied in beside the writable layer and CRIU; elsewhere they are linked
        after the restore. Their sizes and headers passed; their checksums are checked before the worker
        is told to go on, as for a placement after the restore."""
        if not self.weights:
            return
        target = self.node.runtime.restore_target(self.key)
        if target is None:
            return
        self.placing = asyncio.create_task(asyncio.to_thread(self._place_weights, target))
        undo.push_async_callback(_cancel, self.placing)

    # ------------------------------------------------------------------ process
    async def restore_process(self, undo: contextlib.AsyncExitStack) -> Workload:
        """CRIU restores the tree."""
        staged: Path | None = None
        if self.staging is not None:
            # What is left of the unpacking, which began with the check.
            with self.timings.phase("restore", "unpack_wait"):
                staged = await self.staging.wait()
        # Sentinels an earlier container of this pod left must not wake the tree about to come back.
        ctl = self.node.runtime.control_dir(self.key)
        for stale in (protocol.FILE_RESTORE_COMPLETE, protocol.FILE_SNAPSHOT_COMPLETE):
            await asyncio.to_thread((ctl / stale).unlink, missing_ok=True)
        recorded = self.artifact.manifest.extra.get("control_dir")
        source_ctl = recorded if isinstance(recorded, str) else None
        images = staged or self.artifact.path / "criu"
        with self.timings.phase("restore", "writable_layer"):
            try:
                await self.node.runtime.prepare_restore(self.key, images)
            except WorkloadRuntimeError as e:
                raise AgentError(f"CRIU restore failed: {e}") from None
        with self.timings.phase("restore", "criu_restore"):
            try:
                workload = await self.criu_restore(images, source_ctl)
            except WorkloadRuntimeError as e:
                raise AgentError(f"CRIU restore failed: {e}") from None
            finally:
                # CRIU (runc restore -d too) returns once every process has its memory back: the pages
                # are read by then, and the staged copy can go, whatever came of it.
                if self.staging is not None:
                    await self.staging.discard()
        undo.push_async_callback(self.node.runtime.stop, self.key)
        if self.stream is not None:
            undo.push_async_callback(self.stream.abandon)  # its daemon and page server, if it fails on
        return workload

    async def criu_restore(self, images: Path, source_control_dir: str | None) -> Workload:
        """The runtime's restore of the tree from ``images`` (benchmarks/agent_variants.py varies it)."""
        if self.stream is not None:
            return await self.stream.restore(
                self.node.runtime, self.key, images, source_control_dir, self.node.criu
            )
        return await self.node.runtime.restore(self.key, images, source_control_dir)

    async def resume_process(self, workload: Workload) -> None:
        """The tree's CUDA state comes back on the GPUs it was assigned."""
        with self.timings.phase("restore", "cuda_restore"):
            remap = gpu_remap(self.artifact.manifest.gpus, self.gpus)
            cuda = self.node.cuda
            await resume_cuda(cuda, await checkpointed_pids(cuda, workload.pid), remap)

    # ------------------------------------------------------------------ hand over
    async def hand_over(self, workload: Workload, undo: contextlib.AsyncExitStack) -> None:
        """The weights back in place and the worker told to go on. A worker that waits for
        weights-verified is told to resume (and load) before the check ends; any other only once it
        passed. One that reads its weights as they arrive is told while the fetch still brings them."""
        verdict = workload.control_dir / protocol.FILE_WEIGHTS_VERIFIED
        # Left by an earlier restore into this control dir; the worker is still waiting for
        # restore-complete, so it cannot have read them.
        for stale in (verdict, workload.control_dir / protocol.FILE_WEIGHTS_ARRIVED):
            await asyncio.to_thread(stale.unlink, missing_ok=True)
        arriving = await self.put_back_arriving(workload, undo)
        if self._weights_arriving and not arriving:
            await self.weights_fetched(undo)
        check = self.weights_check
        early = (check is not None or arriving) and self.artifact.manifest.extra.get(EARLY_LOAD_KEY) is True
        # Still running: a worker that waits for the verdict resumes now and loads meanwhile.
        pending = early and (arriving or (check is not None and not check.done()))
        if check is not None and not pending:
            self.verified_bytes += await _weights_verdict(check, verdict if early else None, self.timings)
        if self.weights and not arriving:
            # What is left of the placement begun before CRIU, else all of it.
            with self.timings.phase("restore", "place_weights"):
                if self.placing is not None:
                    await self.placing
                else:
                    await asyncio.to_thread(self._place_weights, workload)
        # The writable layer's files CRIU did not need, written beside the restore until now.
        with self.timings.phase("restore", "writable_layer_wait"):
            try:
                beside = await self.node.runtime.finish_restore(self.key)
            except WorkloadRuntimeError as e:
                raise AgentError(f"restore failed: {e}") from None
        if beside is not None:
            self.timings.overlapped["writable_layer_rest"] = round(beside, 4)
        # A worker restored here later must not find this restore's go-ahead.
        undo.push_async_callback(_withdraw_go_ahead, workload.control_dir)
        with self.timings.phase("restore", "signal"):
            await self.signal(workload, pending, arriving)
        if arriving:
            await self.arrived(undo, verdict)
        elif pending and check is not None:
            self.verified_bytes += await _weights_verdict(check, verdict, self.timings)

    async def put_back_arriving(self, workload: Workload, undo: contextlib.AsyncExitStack) -> bool:
        """Weights the fetch still brings linked where the worker loads them, and FILE_WEIGHTS_ARRIVED
        kept up to date; False where they wait for the whole artifact instead (the fetch ended, or a
        file cannot be linked there)."""
        arriving = self.arriving
        if arriving is None or not self._weights_arriving:
            return False
        with self.timings.phase("restore", "weights_headers"):
            try:
                await arriving.headers_in(self.artifact, self.weights)
            except (ValueError, WeightsPlacementError) as e:
                raise ArtifactRefused(f"weights of artifact {self.artifact.key} refused: {e}") from None
        if not arriving.expose():
            return False
        with self.timings.phase("restore", "place_weights"):
            try:
                await asyncio.to_thread(self._place_weights, workload, True)
            except WeightsNotLinked as e:
                log.info("weights wait for the whole artifact", extra={"key": self.key, "reason": str(e)})
                return False
        arriving.feed(workload.control_dir, self.weights)
        undo.push_async_callback(arriving.stop)
        return True

    async def arrived(self, undo: contextlib.AsyncExitStack, verdict: Path) -> None:
        """The fetch's end awaited, then weights-verified: every byte was checked as it arrived."""
        assert self.arriving is not None
        await self.weights_fetched(undo)
        with self.timings.phase("restore", "weights_wait"):
            await self.arriving.fed()
        await asyncio.to_thread(write_sentinel, verdict, {})
        sizes = {f.path: f.size for f in self.with_weights.manifest.files}
        self.verified_bytes += sum(sizes[f] for f in self.weight_files)

    def _place_weights(self, workload: Workload, link_only: bool = False) -> None:
        seen_ctl = self.node.control_dir_seen_by_worker(workload)
        try:
            for w in self.weights:
                target = locate(
                    w.worker_path, seen_ctl, workload.control_dir, host_process=self.node.host_processes
                )
                place_weights(self.with_weights.path / w.file, target, w, link_only=link_only)
        except WeightsNotLinked:
            raise
        except (WeightsPlacementError, OSError) as e:
            raise AgentError(f"cannot put the weights back: {e}") from None

    async def signal(self, workload: Workload, weights_pending: bool, weights_arriving: bool = False) -> None:
        """restore-context.json where the standby left none, then restore-complete: the worker's go-ahead."""
        if self.greeting.env is not None:
            await asyncio.to_thread(ensure_restore_context, workload.control_dir, self.greeting.env)
        # The workload SDK reads who it is now from here (podName, podIP, hostname, env).
        info: dict[str, Any] = {
            "node": self.node.node_name,
            "restoredAt": time.time(),
            **self.greeting.identity,
        }
        if weights_pending:
            info[protocol.RESTORE_WEIGHTS_CHECK] = protocol.WEIGHTS_CHECK_PENDING
        if weights_arriving:
            info[protocol.RESTORE_WEIGHTS_ARRIVING] = True
        fmt = self.artifact.manifest.extra.get(restore_complete.MANIFEST_KEY)
        await asyncio.to_thread(
            restore_complete.write,
            workload.control_dir,
            info,
            workload.pid,
            str(fmt or restore_complete.JSON),
        )


def ensure_restore_context(control_dir: Path, env: Mapping[str, str]) -> None:
    """restore-context.json for a Dynamo worker, from the restore container's env, unless its standby
    entrypoint wrote one (it saw the env as Kubernetes resolved it: Secrets, the Downward API)."""
    path = control_dir / protocol.FILE_RESTORE_CONTEXT
    if present(path):
        return
    context = {"env": {name: env.get(name) for name in sorted(protocol.RESTORE_CONTEXT_ENV_NAMES)}}
    write_sentinel(path, context)


async def _withdraw_go_ahead(control_dir: Path) -> None:
    with contextlib.suppress(OSError):
        go_ahead = control_dir / protocol.FILE_RESTORE_COMPLETE
        await asyncio.to_thread(go_ahead.unlink, missing_ok=True)


async def _weights_verdict(check: asyncio.Task[TreeStats], verdict: Path | None, timings: Timings) -> int:
    """The bytes the weights check read, once it passed; then `verdict` (weights-verified) written."""
    with timings.phase("restore", "weights_wait"):
        checked = (await check).bytes
    if verdict is not None:
        await asyncio.to_thread(write_sentinel, verdict, {})
    return checked


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel a task that may still run, and wait until it has ended. What it failed with is
    retrieved either way: the restore's own error already says it, and a task ended with an
    unretrieved exception is logged as a traceback when collected."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _prefetch_result(task: asyncio.Task[PrefetchStats] | None) -> PrefetchStats | None:
    if task is None:
        return None
    try:
        stats = await task
    except OSError as e:
        log.warning("prefetch failed", extra={"error": str(e)})
        return None
    PREFETCH_BYTES.inc(stats.bytes)
    PREFETCH_SKIPPED.inc(stats.skipped)
    return stats


async def _collect_quietly(task: asyncio.Task[PrefetchStats]) -> None:
    with contextlib.suppress(BaseException):
        await _prefetch_result(task)


def check_process_images(
    node: Node, artifact: Artifact, files: list[str]
) -> tuple[asyncio.Task[TreeStats], bool]:
    """The node's one check of these files of the artifact (``Node.shared_check``): the restore's, or
    one started ahead of it that the restore joins."""
    return node.shared_check(
        artifact.path, files, lambda: artifact.averify(files=files, verified=node.verified)
    )


async def check_ahead(node: Node, artifact: Artifact) -> TreeStats:
    """The restore's check of the process images, begun before the restore itself: a restore into a
    kubelet's pod waits for the kubelet to run the pod's container first, and meanwhile the bytes are
    read and hashed; the restore then joins the check under way, or finds its files verified."""
    check, own = check_process_images(node, artifact, process_files(artifact, carried_weights(artifact)))
    stats = await asyncio.shield(check)
    if own:
        BYTES.labels("restore").inc(stats.bytes)
    return stats
