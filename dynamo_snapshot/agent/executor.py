"""The checkpoint and restore procedures on one node, over CUDA, CRIU (through the runtime) and the artifact
store. Kubernetes-free: the watcher turns pods into calls here and results into annotations.

Checkpoint: wait for `ready-for-checkpoint` → lock and checkpoint CUDA in every CUDA process of the tree
→ CRIU dump → manifest → atomic publish. Restore: verify the artifact (checksums, format, GPU
compatibility) before anything starts → CRIU restore → CUDA restore (GPU UUIDs remapped) and unlock →
`restore-complete`. A failure leaves nothing half-running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from dynamo_snapshot import __version__
from dynamo_snapshot.agent.runtime.base import Runtime, Workload, WorkloadRuntimeError, pid_alive
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import ArtifactError, ArtifactStore, ArtifactWriter, GpuInfo
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.cuda import (
    CudaCheckpointer,
    CudaError,
    ProcessState,
    cuda_available,
    find_cuda_pids,
    node_gpus,
    process_tree,
)

log = logging.getLogger(__name__)

PHASE_SECONDS = Histogram(
    "dynsnap_agent_phase_seconds",
    "Checkpoint/restore time by operation and phase",
    ["op", "phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
)
BYTES = Counter("dynsnap_agent_artifact_bytes_total", "Artifact bytes written or verified", ["op"])
FAILURES = Counter("dynsnap_agent_failures_total", "Failed checkpoints/restores", ["op"])
THROUGHPUT = Gauge("dynsnap_agent_io_gbps", "Artifact read/hash throughput of the last operation", ["op"])


class AgentError(Exception):
    """A checkpoint or restore failed; the message goes into the pod's annotation as it is."""


@dataclass
class Timings:
    phases: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, op: str, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started
            self.phases[name] = round(self.phases.get(name, 0.0) + took, 4)
            PHASE_SECONDS.labels(op, name).observe(took)

    def total(self) -> float:
        return round(sum(self.phases.values()), 4)


@dataclass
class CheckpointOutcome:
    location: str
    artifact_bytes: int
    timings: Timings


@dataclass
class RestoreOutcome:
    workload: Workload
    timings: Timings


class Executor:
    def __init__(
        self,
        runtime: Runtime,
        store: ArtifactStore,
        criu: Criu,
        *,
        node_name: str,
        cuda: CudaCheckpointer | None = None,
        gpus: GpuInfo | None = None,
        cuda_lock_timeout_ms: int = 10_000,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.criu = criu
        self.node_name = node_name
        self.cuda = cuda if cuda is not None else (CudaCheckpointer() if cuda_available() else None)
        self.gpus = gpus if gpus is not None else _local_gpus()
        self.cuda_lock_timeout_ms = cuda_lock_timeout_ms

    # ------------------------------------------------------------------ checkpoint
    async def wait_ready(self, workload: Workload, within: float) -> None:
        """Until the worker says it is safe to checkpoint; fails early if it dies first."""
        sentinel = workload.control_dir / protocol.FILE_READY_FOR_CHECKPOINT
        deadline = time.monotonic() + within
        while not sentinel.exists():
            if not pid_alive(workload.pid):
                raise AgentError(
                    f"worker (pid {workload.pid}) exited before writing {protocol.FILE_READY_FOR_CHECKPOINT}"
                )
            if time.monotonic() > deadline:
                raise AgentError(
                    f"worker did not write {protocol.FILE_READY_FOR_CHECKPOINT} within {within:.0f}s"
                )
            await asyncio.sleep(0.1)

    async def checkpoint(
        self, workload: Workload, identity_hash: str, identity: CheckpointIdentity | None = None
    ) -> CheckpointOutcome:
        t = Timings()
        cuda_pids: list[int] = []
        if self.cuda is not None:
            cuda_pids = await asyncio.to_thread(find_cuda_pids, workload.pid)
        writer = ArtifactWriter(self.store, identity_hash)
        try:
            with t.phase("checkpoint", "cuda_checkpoint"):
                await self._suspend_cuda(cuda_pids)
            images = writer.directory / "criu"
            images.mkdir(parents=True, exist_ok=True)
            with t.phase("checkpoint", "criu_dump"):
                try:
                    await self.runtime.dump(workload, images)
                except WorkloadRuntimeError as e:
                    # CRIU left the tree running: give it its GPU back so the worker carries on.
                    await self._resume_cuda(cuda_pids, {}, best_effort=True)
                    raise AgentError(f"CRIU dump failed: {e}") from None
            with t.phase("checkpoint", "publish"):
                published = await writer.publish(
                    identity=identity,
                    source_node=self.node_name,
                    gpus=self.gpus,
                    criu_version=await self.criu.version(),
                    agent_version=__version__,
                    timings=dict(t.phases),
                    extra={
                        "runtime": self.runtime.name,
                        "control_dir": _control_dir_seen_by_worker(self.runtime.name, workload),
                        "cuda_pids": list(cuda_pids),
                    },
                )
        except BaseException:
            FAILURES.labels("checkpoint").inc()
            writer.discard()
            raise
        artifact = published.artifact
        size = sum(f.size for f in artifact.manifest.files)
        BYTES.labels("checkpoint").inc(size)
        if published.io.seconds > 0:
            THROUGHPUT.labels("checkpoint").set(published.io.bytes / published.io.seconds / 1e9)
        return CheckpointOutcome(str(artifact.path), size, t)

    # ------------------------------------------------------------------ restore
    async def restore(
        self, key: str, identity_hash: str, *, identity_info: dict[str, Any] | None = None
    ) -> RestoreOutcome:
        t = Timings()
        try:
            with t.phase("restore", "verify"):
                try:
                    artifact = await asyncio.to_thread(self.store.open, identity_hash)
                    # Checked before anything starts: a bad artifact never becomes a running process.
                    stats = await artifact.averify(expect_hash=identity_hash)
                except (ArtifactError, ValueError) as e:
                    raise AgentError(f"artifact {identity_hash} refused: {e}") from None
                problems = artifact.compatibility(self.gpus)
                if problems:
                    raise AgentError("incompatible node: " + "; ".join(problems))
            BYTES.labels("restore").inc(stats.bytes)
            if stats.seconds > 0:
                THROUGHPUT.labels("restore").set(stats.bytes / stats.seconds / 1e9)
            extra = artifact.manifest.extra
            with t.phase("restore", "criu_restore"):
                try:
                    source_ctl = extra.get("control_dir")
                    workload = await self.runtime.restore(
                        key, artifact.path / "criu", source_ctl if isinstance(source_ctl, str) else None
                    )
                except WorkloadRuntimeError as e:
                    raise AgentError(f"CRIU restore failed: {e}") from None
            try:
                with t.phase("restore", "cuda_restore"):
                    remap = _gpu_remap(artifact.manifest.gpus, self.gpus)
                    await self._resume_cuda(await self._checkpointed_pids(workload.pid), remap)
            except BaseException:
                await self.runtime.stop(key)
                raise
            with t.phase("restore", "signal"):
                # The workload SDK reads who it is now from here (podName, podIP, hostname, env).
                info = {"node": self.node_name, "restoredAt": time.time(), **(identity_info or {})}
                await asyncio.to_thread(
                    _write_atomic, workload.control_dir / protocol.FILE_RESTORE_COMPLETE, json.dumps(info)
                )
        except BaseException:
            FAILURES.labels("restore").inc()
            raise
        return RestoreOutcome(workload, t)

    # ------------------------------------------------------------------ CUDA
    async def _suspend_cuda(self, pids: list[int]) -> None:
        if not pids or self.cuda is None:
            return
        cuda = self.cuda
        try:
            for pid in pids:  # lock all first: no process may touch the GPU while another is checkpointed
                await asyncio.to_thread(cuda.lock, pid, self.cuda_lock_timeout_ms)
            for pid in pids:
                await asyncio.to_thread(cuda.checkpoint, pid)
        except CudaError as e:
            await self._resume_cuda(pids, {}, best_effort=True)
            raise AgentError(f"CUDA checkpoint failed: {e}") from None

    async def _resume_cuda(
        self, pids: list[int], remap: dict[str, str], *, best_effort: bool = False
    ) -> None:
        if not pids or self.cuda is None:
            return
        cuda = self.cuda
        for pid in pids:
            try:
                state = await asyncio.to_thread(cuda.state, pid)
                if state is ProcessState.CHECKPOINTED:
                    await asyncio.to_thread(cuda.restore, pid, remap or None)
                    state = await asyncio.to_thread(cuda.state, pid)
                if state is ProcessState.LOCKED:
                    await asyncio.to_thread(cuda.unlock, pid)
            except CudaError as e:
                if not best_effort:
                    raise AgentError(f"CUDA restore of pid {pid} failed: {e}") from None
                log.warning("could not resume CUDA", extra={"pid": pid, "error": str(e)})

    async def _checkpointed_pids(self, root_pid: int) -> list[int]:
        """Processes of the restored tree whose CUDA state waits to be restored (they hold no GPU fds
        now, so the driver's own state is the only reliable sign)."""
        if self.cuda is None:
            return []
        cuda = self.cuda

        def scan() -> list[int]:
            found = []
            for pid in process_tree(root_pid):
                with contextlib.suppress(CudaError):
                    if cuda.state(pid) is ProcessState.CHECKPOINTED:
                        found.append(pid)
            return found

        return await asyncio.to_thread(scan)


def _local_gpus() -> GpuInfo | None:
    """This node's GPUs as the manifest records them; None on a node without NVIDIA GPUs."""
    if not cuda_available():
        return None
    try:
        gpus = node_gpus()
    except CudaError as e:
        log.warning("no GPU inventory", extra={"error": str(e)})
        return None
    return GpuInfo.model_validate(dataclasses.asdict(gpus))


def _control_dir_seen_by_worker(runtime: str, workload: Workload) -> str:
    # Inside a container the worker sees the mount path; a host process sees the host directory.
    return protocol.CONTROL_MOUNT_PATH if runtime == "runc" else str(workload.control_dir)


def _gpu_remap(source: GpuInfo | None, target: GpuInfo | None) -> dict[str, str]:
    """Old GPU UUID -> new one for every checkpointed GPU (the driver wants all or none); none when the
    restore lands on the very GPUs it was taken on."""
    if source is None or target is None or list(source.uuids) == list(target.uuids[: len(source.uuids)]):
        return {}
    return dict(zip(source.uuids, target.uuids, strict=False))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
