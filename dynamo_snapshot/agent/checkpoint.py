"""One checkpoint on this node, as stages: wait for the worker's ready file → find its CUDA processes and
what it offloaded → record the node files it maps → lock and checkpoint CUDA → the worker drops the zero
pages of the driver's host copy, where it offers to → CRIU dump → drop zero pages
→ compress pages → carry the weights files → publish the sealed manifest (with the format features the
files use) → `snapshot-complete` for a source left running.

Until the artifact is published, a failure (or a cancellation) discards the staging directory and counts
a failed checkpoint; a failed dump gives the worker its GPU back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import JsonValue

from dynamo_snapshot import __version__
from dynamo_snapshot.agent import restore_complete
from dynamo_snapshot.agent.artifact_files import EARLY_LOAD_KEY, READS_ARRIVING_KEY
from dynamo_snapshot.agent.cuda_processes import resume_cuda, suspend_cuda
from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.gpu_assignment import container_gpus, gpu_memory_held_mib
from dynamo_snapshot.agent.metrics import BYTES, FAILURES, THROUGHPUT
from dynamo_snapshot.agent.node import Node
from dynamo_snapshot.agent.page_images import compress_pages, drop_zero_pages_of, has_packed_pages
from dynamo_snapshot.agent.prefetch import plan_for_tree, write_plan
from dynamo_snapshot.agent.privileges import worker_needs
from dynamo_snapshot.agent.runtime.base import Workload, WorkloadRuntimeError, pid_running
from dynamo_snapshot.agent.runtime.rootfs_diff import DIFF_FILE
from dynamo_snapshot.agent.sentinels import present, write_sentinel
from dynamo_snapshot.agent.timings import Timings
from dynamo_snapshot.agent.weights import (
    CarriedWeights,
    WeightsPlacementError,
    capture_weights,
    locate,
    mib,
    read_offload,
    weights_features,
)
from dynamo_snapshot.agent.zero_page_release import (
    ZeroPageRelease,
    ZeroPagesReleased,
    agent_drops_zero_pages,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import ArtifactWriter, Binding, GpuInfo, PublishResult
from dynamo_snapshot.artifact.manifest import FEATURE_COMPRESSED_PAGES, FEATURE_ROOTFS_DIFF
from dynamo_snapshot.criu.packed import PagesPacked
from dynamo_snapshot.criu.sparse import SparseStats
from dynamo_snapshot.cuda import find_cuda_pids, process_tree
from dynamo_snapshot.workload.weights import OffloadManifest

__all__ = ["CheckpointOutcome", "CheckpointRun", "wait_ready"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointOutcome:
    location: str
    artifact_bytes: int
    timings: Timings
    # The store key published under: "<namespace>/<checkpoint uid>" with a binding, else the identity hash.
    key: str
    # The sealed manifest's digest: what a restore passes as manifest_digest to get exactly this artifact
    # ("" only for an unsealed format-2 artifact another writer had published under the hash first).
    manifest_digest: str


async def wait_ready(workload: Workload, within: float) -> None:
    """Until the worker says it is safe to checkpoint (either generation's ready file); fails early if it
    dies first."""
    sentinels = [workload.control_dir / name for name in protocol.FILES_READY]
    names = " or ".join(protocol.FILES_READY)
    deadline = time.monotonic() + within
    while not any(present(s) for s in sentinels):
        if not pid_running(workload.pid):  # a zombie has exited too
            raise AgentError(f"worker (pid {workload.pid}) exited before writing {names}")
        if time.monotonic() > deadline:
            raise AgentError(
                f"worker did not write {names} in its control dir within {within:.0f}s "
                "(ready-timeout-seconds): is it snapshot-aware, and does it reach the handshake?"
            )
        await asyncio.sleep(0.1)


class CheckpointRun:
    """One checkpoint of ``workload`` into the store under ``key``; ``run`` goes through the stages."""

    def __init__(
        self,
        node: Node,
        workload: Workload,
        identity_hash: str,
        identity: CheckpointIdentity | None,
        binding: Binding | None,
    ) -> None:
        self.node = node
        self.workload = workload
        self.identity_hash = identity_hash
        self.identity = identity
        self.binding = binding
        self.key = binding.key if binding is not None else identity_hash
        self.timings = Timings()
        self.seen_ctl = node.control_dir_seen_by_worker(workload)
        # What the stages find, for the manifest.
        self.gpus: GpuInfo | None = None
        self.cuda_pids: list[int] = []
        self.offload: OffloadManifest | None = None
        self.held_mib = 0
        self.restore_complete_format = restore_complete.JSON
        self.sparse: SparseStats | None = None
        self.released: ZeroPagesReleased | None = None
        self.packed = PagesPacked()
        self.carried: list[CarriedWeights] = []

    async def run(self) -> CheckpointOutcome:
        await self.inspect_worker()
        async with contextlib.AsyncExitStack() as undo:
            writer = ArtifactWriter(self.node.store, self.identity_hash, key=self.key)
            # Until it is published, whatever ends the checkpoint leaves no staging and counts a failure.
            undo.callback(writer.discard)
            undo.callback(FAILURES.labels("checkpoint").inc)
            if self.node.config.checkpoint.prefetch_node_files:
                with self.timings.phase("checkpoint", "prefetch_plan"):
                    await asyncio.to_thread(_record_prefetch_plan, self.workload.pid, writer.directory)
            # Before the worker is touched: weights the agent refuses to carry leave it running.
            await self.carry_weights(writer)
            release = await asyncio.to_thread(
                ZeroPageRelease.prepare, self.workload.control_dir, self.cuda_pids
            )
            with self.timings.phase("checkpoint", "cuda_checkpoint"):
                await suspend_cuda(self.node.cuda, self.cuda_pids, self.node.cuda_lock_timeout_ms)
            if release is not None:
                with self.timings.phase("checkpoint", "release_zero_pages"):
                    self.released = await release.ask()
            images = writer.directory / "criu"
            images.mkdir(parents=True, exist_ok=True)
            await self.dump(images)
            await self.shrink_pages(images)
            published = await self.publish(writer, images)
            undo.pop_all()
        await self.tell_source()
        return self.outcome(published)

    async def inspect_worker(self) -> None:
        """The worker's CUDA processes, the weights it offloaded (weights.json) and the GPU memory it
        holds; nothing is written yet."""
        try:
            tree = await asyncio.to_thread(process_tree, self.workload.pid)
        except ProcessLookupError:
            tree = []  # gone: the dump says so
        needs = await asyncio.to_thread(worker_needs, tree)
        if needs is not None:
            raise AgentError(f"cannot checkpoint this worker: {needs}")
        self.gpus = container_gpus(self.node.gpus, self.workload.visible_gpus)
        if self.node.cuda is not None:
            self.cuda_pids = await asyncio.to_thread(find_cuda_pids, self.workload.pid)
        try:
            self.offload = await asyncio.to_thread(read_offload, self.workload.control_dir)
        except ValueError as e:
            raise AgentError(f"worker's {protocol.FILE_WEIGHTS_MANIFEST} is unreadable: {e}") from None
        self.held_mib = await asyncio.to_thread(gpu_memory_held_mib, self.cuda_pids)
        self.restore_complete_format = await asyncio.to_thread(
            restore_complete.format_for_worker, self.workload.control_dir
        )

    async def dump(self, images: Path) -> None:
        with self.timings.phase("checkpoint", "criu_dump"):
            try:
                await self.node.runtime.dump(self.workload, images)
            except WorkloadRuntimeError as e:
                # CRIU left the tree running: give it its GPU back so the worker carries on. Only a dump
                # that failed is known to have done so, so this is not an undo of the CUDA stage.
                await resume_cuda(self.node.cuda, self.cuda_pids, {}, best_effort=True)
                raise AgentError(f"CRIU dump failed: {e}") from None

    async def shrink_pages(self, images: Path) -> None:
        if agent_drops_zero_pages(self.node.config.checkpoint.drop_zero_pages, self.released):
            with self.timings.phase("checkpoint", "drop_zero_pages"):
                advise = self.node.config.checkpoint.zero_pages_huge_advice
                self.sparse = await drop_zero_pages_of(images, advise)
        if self.node.config.checkpoint.compress_pages:
            with self.timings.phase("checkpoint", "compress_pages"):
                self.packed = await compress_pages(images, self.node.pages_threads)

    async def carry_weights(self, writer: ArtifactWriter) -> None:
        offload = self.offload
        if offload is None or not offload.files:
            return
        with self.timings.phase("checkpoint", "weights_capture"):
            self.carried = await asyncio.to_thread(self._capture_weights, offload, writer)

    def _capture_weights(self, offload: OffloadManifest, writer: ArtifactWriter) -> list[CarriedWeights]:
        try:
            located = {
                f.path: locate(
                    f.path, self.seen_ctl, self.workload.control_dir, host_process=self.node.host_processes
                )
                for f in offload.files
            }
            return capture_weights(offload, located, writer.directory)
        except WeightsPlacementError as e:
            raise AgentError(f"cannot carry the worker's weights: {e}") from None

    async def publish(self, writer: ArtifactWriter, images: Path) -> PublishResult:
        features = await asyncio.to_thread(self._features, writer, images)
        with self.timings.phase("checkpoint", "publish"):
            return await writer.publish(
                identity=self.identity,
                source_node=self.node.node_name,
                gpus=self.gpus,
                criu_version=await self.node.criu.version(),
                agent_version=__version__,
                binding=self.binding,
                timings=dict(self.timings.phases),
                extra=self._extra(),
                features=features,
            )

    def _features(self, writer: ArtifactWriter, images: Path) -> set[str]:
        """The optional formats the staged files use, which a reader must know (see artifact.manifest)."""
        try:
            used = weights_features([writer.directory / w.file for w in self.carried])
        except WeightsPlacementError as e:
            raise AgentError(f"cannot carry the worker's weights: {e}") from None
        if has_packed_pages(images):
            used.add(FEATURE_COMPRESSED_PAGES)
        if (images / DIFF_FILE).exists():
            used.add(FEATURE_ROOTFS_DIFF)
        return used

    def _extra(self) -> dict[str, JsonValue]:
        offload, packed = self.offload, self.packed
        released_mib = mib(sum(offload.released_bytes.values())) if offload is not None else 0
        return {
            "runtime": self.node.runtime.name,
            "image": self.workload.image_id,
            "control_dir": self.seen_ctl,
            "cuda_pids": list(self.cuda_pids),
            "weights": [w.to_json() for w in self.carried],
            "gpuMemory": {"heldMiB": self.held_mib, "releasedMiB": released_mib},
            # What restore-complete the checkpointed process reads.
            restore_complete.MANIFEST_KEY: self.restore_complete_format,
            "zeroPagesDropped": self.sparse.pages_dropped if self.sparse is not None else 0,
            "zeroPageBytesReleased": self.released.released_bytes if self.released is not None else 0,
            # The worker's own account of its scan, beside the phase's round trip.
            "zeroPageReleaseWorker": self.released.account() if self.released is not None else None,
            "pagesCompressed": {
                "files": packed.files,
                "bytesBefore": packed.bytes_before,
                "bytesAfter": packed.bytes_after,
            },
            # The worker waits for weights-verified: a restore may signal it before then.
            EARLY_LOAD_KEY: bool(self.carried) and offload is not None and offload.waits_for_weights_check,
            # Its loads wait for each byte: a restore may put the weights back while they arrive.
            READS_ARRIVING_KEY: bool(self.carried)
            and offload is not None
            and offload.waits_for_weights_check
            and offload.reads_arriving_weights,
        }

    async def tell_source(self) -> None:
        if pid_running(self.workload.pid):
            # A source the runtime left running (a kubelet's container) learns that its checkpoint is
            # published, and ends.
            await asyncio.to_thread(
                write_sentinel, self.workload.control_dir / protocol.FILE_SNAPSHOT_COMPLETE, {"key": self.key}
            )

    def outcome(self, published: PublishResult) -> CheckpointOutcome:
        artifact = published.artifact
        size = sum(f.size for f in artifact.manifest.files)
        BYTES.labels("checkpoint").inc(size)
        if published.io.seconds > 0:
            THROUGHPUT.labels("checkpoint").set(published.io.bytes / published.io.seconds / 1e9)
        return CheckpointOutcome(
            str(artifact.path), size, self.timings, artifact.key, artifact.manifest.digest or ""
        )


def _record_prefetch_plan(root_pid: int, directory: Path) -> None:
    """The tree's mapped node files into the artifact; a checkpoint never fails for want of it."""
    try:
        plan = plan_for_tree(process_tree(root_pid) or [root_pid])
        write_plan(plan, directory)
    except (OSError, ValueError) as e:
        log.warning("no prefetch plan", extra={"pid": root_pid, "error": str(e)})
        return
    log.info(
        "prefetch plan recorded",
        extra={"files": len(plan.files), "bytes": plan.bytes, "unresolved": plan.unresolved},
    )
