"""The checkpoint and restore procedures on one node, over CUDA, CRIU (through the runtime) and the artifact
store. Kubernetes-free: the watcher turns pods into calls here and results into annotations.

Checkpoint: wait for `ready-for-snapshot` (or `ready-for-checkpoint`) → lock and checkpoint CUDA in every
CUDA process of the tree → CRIU dump → carry the worker's weights files (weights.json) → manifest, bound
to the checkpoint and sealed by its digest → atomic publish under `<namespace>/<checkpoint uid>` →
`snapshot-complete` for a source left running. Restore: verify the artifact's manifest (its seal, its
binding, the digest the checkpoint recorded), process images, the weights files' sizes and headers, GPU
compatibility and free GPU memory before anything starts → CRIU restore and CUDA restore (GPU UUIDs
remapped) while the weights' chunk digests are checked → weights linked back → `restore-context.json`
(where the worker's standby left none) → `restore-complete` → `weights-verified`. A worker whose SDK
waits for `weights-verified` gets `restore-complete` as soon as its process is back, so it loads its
weights while the check still reads them; any other gets it only after the check. A failure leaves
nothing running. An artifact is deleted only while no restore on this node reads it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from pydantic import JsonValue

from dynamo_snapshot import __version__
from dynamo_snapshot.agent.prefetch import (
    PREFETCH_FILE,
    PrefetchStats,
    plan_for_tree,
    prefetch,
    read_plan,
    read_whole,
    write_plan,
)
from dynamo_snapshot.agent.runtime.base import Runtime, Workload, WorkloadRuntimeError, pid_running
from dynamo_snapshot.agent.weights import (
    CarriedWeights,
    WeightsPlacementError,
    capture_weights,
    check_carried,
    gpu_memory_problem,
    host_path,
    mib,
    place_weights,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import (
    HASH_PARALLEL,
    Artifact,
    ArtifactCache,
    ArtifactError,
    ArtifactNotFoundError,
    ArtifactStore,
    ArtifactWriter,
    Binding,
    GpuInfo,
    TreeStats,
    VerifiedFiles,
    validate_artifact_key,
    warm_up_hashing,
)
from dynamo_snapshot.criu import Criu, CriuError
from dynamo_snapshot.criu.packed import (
    DEFAULT_THREADS,
    PackedFormatError,
    PagesPacked,
    StageStats,
    is_packed_pages,
    pack_pages,
    stage_images,
    staged_bytes,
)
from dynamo_snapshot.criu.sparse import PAGE, ImageFormatError, SparseStats, drop_zero_pages
from dynamo_snapshot.cuda import (
    CudaCheckpointer,
    CudaError,
    ProcessState,
    cuda_available,
    find_cuda_pids,
    gpu_memory_by_pid,
    list_gpus,
    node_gpus,
    process_tree,
)
from dynamo_snapshot.workload.weights import OffloadManifest, read_offload_manifest

log = logging.getLogger(__name__)
T = TypeVar("T")

PHASE_SECONDS = Histogram(
    "dynsnap_agent_phase_seconds",
    "Checkpoint/restore time by operation and phase",
    ["op", "phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
)
BYTES = Counter("dynsnap_agent_artifact_bytes_total", "Artifact bytes written or verified", ["op"])
FAILURES = Counter("dynsnap_agent_failures_total", "Failed checkpoints/restores", ["op"])
THROUGHPUT = Gauge("dynsnap_agent_io_gbps", "Artifact read/hash throughput of the last operation", ["op"])
PREFETCH_BYTES = Counter(
    "dynsnap_agent_prefetch_bytes_total", "Node-file bytes restores asked the kernel to read ahead"
)
PREFETCH_SKIPPED = Counter(
    "dynsnap_agent_prefetch_skipped_files_total",
    "Files of a prefetch plan missing or changed on this node (not read ahead)",
)
ZERO_PAGES_DROPPED = Counter(
    "dynsnap_agent_zero_page_bytes_dropped_total",
    "Bytes of all-zero anonymous pages left out of checkpoints' CRIU images",
)
PAGES_COMPRESSED_SAVED = Counter(
    "dynsnap_agent_page_bytes_compressed_saved_total",
    "Bytes checkpoints' CRIU pages images shrank by being stored compressed",
)
CACHE_RESTORES = Counter(
    "dynsnap_agent_cache_restores_total",
    "Restores on a node with an artifact cache, by where the artifact was read: cache, store, or "
    "refused (the cached copy failed its check; restored from the store)",
    ["source"],
)
CACHE_FILLS = Counter(
    "dynsnap_agent_cache_fills_total",
    "Copies of artifacts into the node cache after a restore from the store: filled, no_room, failed",
    ["result"],
)
CACHE_BYTES = Gauge("dynsnap_agent_cache_bytes", "Bytes of artifacts in the node cache")
# Where a restore unpacks compressed pages for CRIU: a tmpfs, so CRIU reads them at memory speed.
DEFAULT_RESTORE_SCRATCH = Path("/dev/shm/dynamo-snapshot")
# Free space a scratch directory must have beyond the unpacked pages.
_SCRATCH_MARGIN = 64 << 20


class AgentError(Exception):
    """A checkpoint or restore failed; the message goes into the pod's annotation as it is."""


class ArtifactRefused(AgentError):
    """The artifact's files (or its manifest) are not what it sealed: missing, truncated, altered; or it is
    not the artifact the checkpoint recorded."""


@dataclass
class Timings:
    phases: dict[str, float] = field(default_factory=dict)
    # Work done beside the phases (not part of their sum), e.g. weights verified during CRIU restore.
    overlapped: dict[str, float] = field(default_factory=dict)

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
    # The store key published under: "<namespace>/<checkpoint uid>" with a binding, else the identity hash.
    key: str
    # The sealed manifest's digest: what a restore passes as manifest_digest to get exactly this artifact
    # ("" only for an unsealed format-2 artifact another writer had published under the hash first).
    manifest_digest: str


@dataclass
class RestoreOutcome:
    workload: Workload
    timings: Timings
    prefetch: PrefetchStats | None = None
    # Where the artifact was read: "store", or "cache" (the node cache's copy).
    source: str = "store"


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
        overlap_page_check: bool = False,
        verify_cache_s: float = 3600.0,
        prefetch_node_files: bool = True,
        weights_check_idle_io: bool = True,
        weights_check_parallel: int | None = None,
        drop_zero_pages: bool = True,
        compress_pages: bool = True,
        restore_scratch: Path | None = DEFAULT_RESTORE_SCRATCH,
        pages_threads: int | None = None,
        cache: ArtifactCache | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.criu = criu
        self.node_name = node_name
        self.cuda = cuda if cuda is not None else (CudaCheckpointer() if cuda_available() else None)
        self.gpus = gpus if gpus is not None else _local_gpus()
        self.cuda_lock_timeout_ms = cuda_lock_timeout_ms
        # Off by default: measured on the H200, CRIU reading pages from disk while they are checked
        # in parallel was slower than checking them first (at full parallel read speed) and letting
        # CRIU read them from the page cache.
        self.overlap_page_check = overlap_page_check
        # Restores 2..N of one checkpoint on this node skip hashing files verified unchanged (0: never).
        self.verified = VerifiedFiles(ttl_s=verify_cache_s) if verify_cache_s > 0 else None
        # Record the node files the worker maps at checkpoint; read them ahead at restore.
        self.prefetch_node_files = prefetch_node_files
        # The weights check beside CRIU at idle I/O priority, so CRIU's reads (on the critical path) go
        # first. Restores on the H200, idle vs normal priority, same artifact (BENCHMARKS.md): 8 GiB of
        # weights 5.26/6.43, 5.14/7.21, 6.71/6.93 s; 1 GiB 3.33/3.24, 3.56/3.42 s.
        self.weights_check_idle_io = weights_check_idle_io
        # Leave the zero pages of anonymous memory out of the CRIU images (see criu.sparse).
        self.drop_zero_pages = drop_zero_pages
        # Store the pages images compressed (see criu.packed); a restore unpacks them into a staging
        # images directory under restore_scratch (None, or unusable: beside the workload's control dir).
        self.compress_pages = compress_pages
        self.restore_scratch = restore_scratch
        self.pages_threads = pages_threads or DEFAULT_THREADS
        self._scratch_cleaned: set[Path] = set()
        # Threads of the weights check beside CRIU (None: the artifact default, twice the cores).
        self.weights_check_parallel = weights_check_parallel
        self._verifying: dict[str, asyncio.Lock] = {}
        # A node-local copy of the store's artifacts (None: every restore reads the store).
        self.cache = cache
        self._fills: dict[str, asyncio.Task[None]] = {}
        # Restores under way per artifact key, and keys being deleted: delete_artifact removes nothing a
        # restore reads, and no restore starts on what it is removing.
        self._reading: collections.Counter[str] = collections.Counter()
        self._deleting: collections.Counter[str] = collections.Counter()
        # Big files are hashed in a helper process (see artifact.isolated); start it before it is needed.
        warm_up_hashing()

    # ------------------------------------------------------------------ checkpoint
    async def wait_ready(self, workload: Workload, within: float) -> None:
        """Until the worker says it is safe to checkpoint (either generation's ready file); fails early if
        it dies first."""
        sentinels = [workload.control_dir / name for name in protocol.FILES_READY]
        names = " or ".join(protocol.FILES_READY)
        deadline = time.monotonic() + within
        while not any(s.exists() for s in sentinels):
            if not pid_running(workload.pid):  # a zombie has exited too
                raise AgentError(f"worker (pid {workload.pid}) exited before writing {names}")
            if time.monotonic() > deadline:
                raise AgentError(
                    f"worker did not write {names} in its control dir within {within:.0f}s "
                    "(ready-timeout-seconds): is it snapshot-aware, and does it reach the handshake?"
                )
            await asyncio.sleep(0.1)

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
        key = binding.key if binding is not None else identity_hash
        t = Timings()
        cuda_pids: list[int] = []
        if self.cuda is not None:
            cuda_pids = await asyncio.to_thread(find_cuda_pids, workload.pid)
        seen_ctl = _control_dir_seen_by_worker(self.runtime.name, workload)
        try:
            offload = await asyncio.to_thread(read_offload_manifest, workload.control_dir)
        except ValueError as e:
            raise AgentError(f"worker's {protocol.FILE_WEIGHTS_MANIFEST} is unreadable: {e}") from None
        held_mib = await asyncio.to_thread(_gpu_memory_held_mib, cuda_pids)
        writer = ArtifactWriter(self.store, identity_hash, key=key)
        try:
            if self.prefetch_node_files:
                with t.phase("checkpoint", "prefetch_plan"):
                    await asyncio.to_thread(_record_prefetch_plan, workload.pid, writer.directory)
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
            sparse: SparseStats | None = None
            if self.drop_zero_pages:
                with t.phase("checkpoint", "drop_zero_pages"):
                    sparse = await _drop_zero_pages(images)
            packed = PagesPacked()
            if self.compress_pages:
                with t.phase("checkpoint", "compress_pages"):
                    packed = await _compress_pages(images, self.pages_threads)
            carried: list[CarriedWeights] = []
            if offload is not None and offload.files:
                with t.phase("checkpoint", "weights_capture"):
                    carried = await asyncio.to_thread(
                        self._capture_weights, offload, seen_ctl, workload, writer.directory
                    )
            released_mib = mib(sum(offload.released_bytes.values())) if offload is not None else 0
            with t.phase("checkpoint", "publish"):
                published = await writer.publish(
                    identity=identity,
                    source_node=self.node_name,
                    gpus=self.gpus,
                    criu_version=await self.criu.version(),
                    agent_version=__version__,
                    binding=binding,
                    timings=dict(t.phases),
                    extra={
                        "runtime": self.runtime.name,
                        "image": workload.image_id,
                        "control_dir": seen_ctl,
                        "cuda_pids": list(cuda_pids),
                        "weights": [w.to_json() for w in carried],
                        "gpuMemory": {"heldMiB": held_mib, "releasedMiB": released_mib},
                        "zeroPagesDropped": sparse.pages_dropped if sparse is not None else 0,
                        "pagesCompressed": {
                            "files": packed.files,
                            "bytesBefore": packed.bytes_before,
                            "bytesAfter": packed.bytes_after,
                        },
                        # The worker waits for weights-verified: a restore may signal it before then.
                        "weightsEarlyLoad": bool(carried)
                        and offload is not None
                        and offload.waits_for_weights_check,
                    },
                )
        except BaseException:
            FAILURES.labels("checkpoint").inc()
            writer.discard()
            raise
        if pid_running(workload.pid):
            # A source the runtime left running (a kubelet's container) learns that its checkpoint is
            # published, and ends.
            await asyncio.to_thread(
                _write_atomic,
                workload.control_dir / protocol.FILE_SNAPSHOT_COMPLETE,
                json.dumps({"key": key}),
            )
        artifact = published.artifact
        size = sum(f.size for f in artifact.manifest.files)
        BYTES.labels("checkpoint").inc(size)
        if published.io.seconds > 0:
            THROUGHPUT.labels("checkpoint").set(published.io.bytes / published.io.seconds / 1e9)
        return CheckpointOutcome(str(artifact.path), size, t, artifact.key, artifact.manifest.digest or "")

    def _capture_weights(
        self, offload: OffloadManifest, seen_ctl: str, workload: Workload, staging: Path
    ) -> list[CarriedWeights]:
        containerized = self.runtime.name == "runc"
        try:
            to_host = {
                f.path: host_path(f.path, seen_ctl, workload.control_dir, containerized=containerized)
                for f in offload.files
            }
            return capture_weights(offload, to_host, staging)
        except WeightsPlacementError as e:
            raise AgentError(f"cannot carry the worker's weights: {e}") from None

    # ------------------------------------------------------------------ restore
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
    ) -> RestoreOutcome:
        """Restore the artifact ``artifact_key`` as workload ``key``: from the node cache's copy when it
        holds the store's current one (a refused copy is dropped and the store's used instead), else
        from the store, after which a copy is put into the node cache in the background. With
        ``manifest_digest``, only an artifact whose sealed manifest has exactly that digest is used;
        with ``image_id`` (the image the restore container runs), only one taken from that image; with
        ``visible_gpus`` (the restore container's GPUs), onto those. ``restore_env`` (the restore
        container's environment) fills restore-context.json where the worker's standby left none."""
        if self._deleting[artifact_key]:
            FAILURES.labels("restore").inc()
            raise ArtifactRefused(f"artifact {artifact_key} refused: it is being deleted")
        self._reading[artifact_key] += 1
        try:
            greeting = _Greeting(identity_info or {}, restore_env)
            return await self._restore_reading(
                key, artifact_key, greeting, manifest_digest, image_id, visible_gpus
            )
        finally:
            self._reading[artifact_key] -= 1
            if not self._reading[artifact_key]:
                del self._reading[artifact_key]

    async def _restore_reading(
        self,
        key: str,
        artifact_key: str,
        greeting: _Greeting,
        manifest_digest: str | None,
        image_id: str | None,
        visible_gpus: tuple[str, ...] | None,
    ) -> RestoreOutcome:
        t = Timings()
        try:
            with t.phase("restore", "verify"):
                try:
                    artifact = await asyncio.to_thread(self.store.open, artifact_key)
                except (ArtifactError, ValueError) as e:
                    raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
                _check_digest(artifact, manifest_digest)
                _check_image(artifact, image_id)
                assigned_gpus(self.gpus, visible_gpus, artifact.manifest.gpus)
            if self.cache is not None:
                cached = await self._restore_from_cache(
                    self.cache, key, artifact, t, greeting, manifest_digest
                )
                if cached is not None:
                    return cached
            outcome = await self._restore(key, artifact, t, greeting, manifest_digest)
        except BaseException:
            FAILURES.labels("restore").inc()
            raise
        if self.cache is not None:
            CACHE_RESTORES.labels("store").inc()
            self._start_fill(artifact)
        return outcome

    async def _restore_from_cache(
        self,
        cache: ArtifactCache,
        key: str,
        source: Artifact,
        t: Timings,
        greeting: _Greeting,
        manifest_digest: str | None,
    ) -> RestoreOutcome | None:
        """From the node cache's copy of ``source``; None where it has none, or its copy was refused
        (the copy is then removed)."""
        artifact_key = source.key
        # Pinned before the lookup: a fill making room cannot take the copy once it was found.
        with cache.pinned(artifact_key):
            with t.phase("restore", "verify"):
                cached = await asyncio.to_thread(cache.lookup, source)
            if cached is None:
                return None
            try:
                outcome = await self._restore(key, cached, t, greeting, manifest_digest)
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

    async def delete_artifact(self, artifact_key: str) -> bool:
        """Remove the artifact ``artifact_key`` from the store and the node cache. False, removing
        nothing, while a restore on this node reads it; True once removed, or when there was none.

        No restore of it starts meanwhile, and a copy into the node cache under way is waited for (it
        cannot be stopped halfway), so no copy outlives the artifact. ``ValueError`` for a bad key.
        """
        validate_artifact_key(artifact_key)
        if self._reading[artifact_key]:
            return False
        self._deleting[artifact_key] += 1
        try:
            filling = self._fills.get(artifact_key)
            if filling is not None:
                await asyncio.wait([filling])
            removed = await asyncio.to_thread(self.store.delete, artifact_key)
            cache = self.cache
            if cache is not None:
                removed = await asyncio.to_thread(cache.discard, artifact_key) or removed
                CACHE_BYTES.set(await asyncio.to_thread(cache.used_bytes))
        finally:
            self._deleting[artifact_key] -= 1
            if not self._deleting[artifact_key]:
                del self._deleting[artifact_key]
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

    async def _restore(
        self,
        key: str,
        artifact: Artifact,
        t: Timings,
        greeting: _Greeting,
        manifest_digest: str | None,
    ) -> RestoreOutcome:
        artifact_key = artifact.key
        prefetching: asyncio.Task[PrefetchStats] | None = None
        staging: asyncio.Task[Path] | None = None
        weights_check: asyncio.Task[TreeStats] | None = None
        try:
            with t.phase("restore", "verify"):
                # The store's artifact passed this already; the node cache's copy is held to it too.
                _check_digest(artifact, manifest_digest)
                try:
                    weights = [CarriedWeights.from_json(w) for w in _list(artifact.manifest.extra, "weights")]
                except (ValueError, WeightsPlacementError) as e:
                    raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
                problems = artifact.compatibility(self.gpus)
                if problems:
                    raise AgentError("incompatible node: " + "; ".join(problems))
                await self._check_gpu_memory(artifact.manifest.extra, artifact.manifest.gpus)
                await self._read_tools()
                prefetching = await self._start_prefetch(artifact)
                weight_files = {w.file for w in weights}
                process_files = [f.path for f in artifact.manifest.files if f.path not in weight_files]
                # Compressed pages are unpacked (into a directory of this restore's own) while they are
                # checked; CRIU starts on them only once the check passed.
                staging = self._start_staging(key, artifact, t)
                if weights and self.weights_check_idle_io:
                    # At idle I/O priority the weights check takes only the disk time nobody else
                    # wants, so it can start now, beside the check of what CRIU needs.
                    weights_check = asyncio.create_task(
                        self._verify_weights(artifact, sorted(weight_files), t)
                    )
                # The memory pages are most of the bytes. Where the runtime can hold the restored tree
                # stopped, they are checked while CRIU restores them and the tree runs only once they
                # passed; everything else (the metadata CRIU acts on) is checked before CRIU starts.
                # Compressed pages are not plain pages-N.img: they are checked here.
                overlap = self.overlap_page_check and self.runtime.restores_stopped
                pages = [f for f in process_files if _is_pages(f)] if overlap else []
                try:
                    # Concurrent restores of one artifact wait for the first one's hashing and then
                    # find its files verified, instead of all reading the same bytes at once.
                    async with self._verifying.setdefault(str(artifact.path), asyncio.Lock()):
                        stats = await artifact.averify(
                            files=[f for f in process_files if f not in pages],
                            verified=self.verified,
                        )
                    verified_bytes = stats.bytes
                except (ArtifactError, ValueError) as e:
                    raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
                try:
                    await artifact.averify(files=sorted(weight_files), check_checksums=False)
                    for w in weights:
                        await asyncio.to_thread(check_carried, artifact.path / w.file, w)
                except (ArtifactError, ValueError, WeightsPlacementError) as e:
                    raise ArtifactRefused(f"weights of artifact {artifact_key} refused: {e}") from None
            # The weights are checked while CRIU restores the process: the same read fills the page
            # cache the worker loads them from. A worker that waits for weights-verified is told to
            # resume (and load) before the check ends; any other only once it passed.
            if weights and weights_check is None:
                weights_check = asyncio.create_task(self._verify_weights(artifact, sorted(weight_files), t))
            early = weights_check is not None and artifact.manifest.extra.get("weightsEarlyLoad") is True
            pages_check = (
                asyncio.create_task(artifact.averify(files=pages, verified=self.verified)) if pages else None
            )
            try:
                workload = await self._restore_process(key, artifact, t, pages_check, staging)
                if pages_check is not None:
                    verified_bytes += pages_check.result().bytes
                verdict = workload.control_dir / protocol.FILE_WEIGHTS_VERIFIED
                try:
                    # Left by an earlier restore into this control dir; the worker is still waiting
                    # for restore-complete, so it cannot have read it.
                    await asyncio.to_thread(verdict.unlink, missing_ok=True)
                    # Still running: a worker that waits for the verdict resumes now and loads meanwhile.
                    pending = early and weights_check is not None and not weights_check.done()
                    if weights_check is not None and not pending:
                        verified_bytes += await _weights_verdict(weights_check, verdict if early else None, t)
                    if weights:
                        await asyncio.to_thread(self._place_weights, artifact, weights, workload)
                    with t.phase("restore", "signal"):
                        if greeting.env is not None:
                            await asyncio.to_thread(
                                _ensure_restore_context, workload.control_dir, greeting.env
                            )
                        # The workload SDK reads who it is now from here (podName, podIP, hostname, env).
                        info: dict[str, Any] = {
                            "node": self.node_name,
                            "restoredAt": time.time(),
                            **greeting.identity,
                        }
                        if pending:
                            info[protocol.RESTORE_WEIGHTS_CHECK] = protocol.WEIGHTS_CHECK_PENDING
                        await asyncio.to_thread(
                            _write_atomic,
                            workload.control_dir / protocol.FILE_RESTORE_COMPLETE,
                            json.dumps(info),
                        )
                    if pending and weights_check is not None:
                        verified_bytes += await _weights_verdict(weights_check, verdict, t)
                except BaseException:
                    await self.runtime.stop(key)
                    # A worker restored here later must not find this restore's go-ahead.
                    with contextlib.suppress(OSError):
                        go_ahead = workload.control_dir / protocol.FILE_RESTORE_COMPLETE
                        await asyncio.to_thread(go_ahead.unlink, missing_ok=True)
                    raise
            finally:
                await _cancel(weights_check)
            BYTES.labels("restore").inc(verified_bytes)
            if stats.seconds > 0:
                THROUGHPUT.labels("restore").set(stats.bytes / stats.seconds / 1e9)
            prefetched = await _prefetch_result(prefetching)
        except BaseException:
            with contextlib.suppress(BaseException):
                await _prefetch_result(prefetching)  # its thread ends on its own; just collect it
            await _cancel(weights_check)
            await _discard_staging(staging)
            raise
        return RestoreOutcome(workload, t, prefetched)

    def _start_fill(self, artifact: Artifact) -> None:
        """Copy ``artifact`` into the node cache in the background (one copy per checkpoint at a time)."""
        artifact_key = artifact.key
        if self.cache is None or artifact_key in self._fills:
            return
        task = asyncio.create_task(self._fill(self.cache, artifact), name=f"cache-{artifact_key}")
        self._fills[artifact_key] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._fills.get(artifact_key) is done:
                del self._fills[artifact_key]

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
        await asyncio.gather(*self._fills.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop the node cache copies in progress (an unfinished copy is never published)."""
        for task in self._fills.values():
            task.cancel()
        await self.wait_cache_fills()

    async def _read_tools(self) -> None:
        """CRIU's (and the runtime's) own files into the page cache before the bulk reads begin."""
        if not self.prefetch_node_files:
            return
        try:
            files = [*await self.criu.files(), *self.runtime.tool_files()]
        except (CriuError, OSError) as e:
            log.warning("cannot list CRIU's files to read ahead", extra={"error": str(e)})
            return
        stats = await asyncio.to_thread(read_whole, files)
        log.debug("tools read ahead", extra={"files": stats.files, "bytes": stats.bytes, "s": stats.seconds})

    async def _start_prefetch(self, artifact: Artifact) -> asyncio.Task[PrefetchStats] | None:
        """Start reading the node files the checkpoint's plan names; None without a (valid) plan."""
        if not self.prefetch_node_files or not any(f.path == PREFETCH_FILE for f in artifact.manifest.files):
            return None
        try:
            await artifact.averify(files=[PREFETCH_FILE], verified=self.verified)
            plan = await asyncio.to_thread(read_plan, artifact.file_path(PREFETCH_FILE))
        except (ArtifactError, ValueError, OSError) as e:
            # Only a hint: the full check below refuses the artifact if the plan was tampered with.
            log.warning("prefetch plan unusable", extra={"error": str(e)})
            return None
        return asyncio.create_task(asyncio.to_thread(prefetch, plan))

    async def _restore_process(
        self,
        key: str,
        artifact: Artifact,
        t: Timings,
        pages_check: asyncio.Task[TreeStats] | None,
        staging: asyncio.Task[Path] | None,
    ) -> Workload:
        extra = artifact.manifest.extra
        images = artifact.path / "criu"
        staged: Path | None = None
        try:
            if staging is not None:
                # What is left of the unpacking, which began with the check.
                with t.phase("restore", "unpack_wait"):
                    staged = await staging
            # Sentinels an earlier container of this pod left must not wake the tree about to come back.
            ctl = self.runtime.control_dir(key)
            for stale in (protocol.FILE_RESTORE_COMPLETE, protocol.FILE_SNAPSHOT_COMPLETE):
                await asyncio.to_thread((ctl / stale).unlink, missing_ok=True)
            with t.phase("restore", "criu_restore"):
                try:
                    source_ctl = extra.get("control_dir")
                    workload = await self.runtime.restore(
                        key,
                        staged or images,
                        source_ctl if isinstance(source_ctl, str) else None,
                        stopped=pages_check is not None,
                    )
                except WorkloadRuntimeError as e:
                    raise AgentError(f"CRIU restore failed: {e}") from None
                finally:
                    # CRIU (runc restore -d too) returns once every process has its memory back: the
                    # pages are read by then, and the staged copy can go.
                    if staged is not None:
                        await asyncio.to_thread(shutil.rmtree, staged, True)
        except BaseException:
            await _cancel(pages_check)
            raise
        try:
            if pages_check is not None:
                with t.phase("restore", "pages_wait"):
                    try:
                        await pages_check
                    except (ArtifactError, ValueError) as e:
                        raise ArtifactRefused(f"artifact {artifact.key} refused: {e}") from None
                await self.runtime.resume(workload)
            with t.phase("restore", "cuda_restore"):
                target = assigned_gpus(self.gpus, workload.visible_gpus, artifact.manifest.gpus)
                remap = _gpu_remap(artifact.manifest.gpus, target)
                await self._resume_cuda(await self._checkpointed_pids(workload.pid), remap)
        except BaseException:
            await self.runtime.stop(key)
            raise
        return workload

    def _start_staging(self, key: str, artifact: Artifact, t: Timings) -> asyncio.Task[Path] | None:
        """Unpack the artifact's compressed pages for CRIU, in a task; None where it has none."""
        criu_files = [
            f.path.removeprefix("criu/") for f in artifact.manifest.files if f.path.startswith("criu/")
        ]
        if not any(is_packed_pages(f) for f in criu_files):
            return None

        async def stage() -> Path:
            started = time.monotonic()
            staged = await self._stage_images(key, artifact.path / "criu", criu_files, artifact.key)
            t.overlapped["unpack_pages"] = round(time.monotonic() - started, 4)
            return staged

        return asyncio.create_task(stage())

    async def _stage_images(self, key: str, images: Path, files: list[str], artifact_key: str) -> Path:
        """A new images directory for CRIU: the artifact's compressed pages unpacked, its other images
        copied. On the scratch tmpfs; where that is unusable or too small, beside the workload's control
        dir. Only the files the artifact seals (``files``); they are being checked meanwhile, and CRIU
        runs on the directory only once that check passed."""
        try:
            need = await asyncio.to_thread(staged_bytes, images, files)
        except (PackedFormatError, OSError) as e:
            raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
        fallback = self.runtime.control_dir(key).parent / ".restore-images"
        bases = [b for b in (self.restore_scratch, fallback) if b is not None]
        problems = []
        for base in bases:
            try:
                staged, stats = await self._unpack_into(base, key, need, images, files)
            except PackedFormatError as e:
                raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
            except OSError as e:  # no room, or not writable: the next place
                problems.append(f"{base}: {e}")
                log.warning("cannot unpack the CRIU pages here", extra={"dir": str(base), "error": str(e)})
                continue
            log.info(
                "CRIU pages unpacked",
                extra={
                    "dir": str(staged),
                    "bytes": stats.bytes,
                    "packed_bytes": stats.packed_bytes,
                    "seconds": round(stats.seconds, 3),
                },
            )
            return staged
        raise AgentError("cannot unpack the CRIU pages: " + "; ".join(problems))

    async def _unpack_into(
        self, base: Path, key: str, need: int, images: Path, files: list[str]
    ) -> tuple[Path, StageStats]:
        """Unpack into a fresh directory under ``base``; whatever fails leaves nothing there."""
        staged = await asyncio.to_thread(self._scratch_dir, base, key, need)
        try:
            stats = await _in_thread_stoppable(
                lambda stop: stage_images(images, files, staged, threads=self.pages_threads, stop=stop)
            )
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, staged, True)
            raise
        return staged, stats

    def _scratch_dir(self, base: Path, key: str, need: int) -> Path:
        """A fresh directory under ``base`` with room for ``need`` bytes more, else ``OSError``."""
        base.mkdir(parents=True, exist_ok=True)
        if base not in self._scratch_cleaned:
            _remove_abandoned(base)
            self._scratch_cleaned.add(base)
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        if free < need + _SCRATCH_MARGIN:
            raise OSError(f"{free >> 20} MiB free, the pages need {need >> 20} MiB")
        staged = base / f"{os.getpid()}-{key}-{secrets.token_hex(4)}"
        staged.mkdir(mode=0o700)
        return staged

    async def _verify_weights(self, artifact: Artifact, files: list[str], t: Timings) -> TreeStats:
        # Timed apart from the phases it overlaps; "weights_wait" is what it added to the restore.
        started = time.monotonic()
        try:
            # Linking the weights into a worker's control dir changes their status-change time, so
            # the cache rarely spares this check; it stays correct either way.
            return await artifact.averify(
                files=files,
                verified=self.verified,
                idle_io=self.weights_check_idle_io,
                parallel=self.weights_check_parallel or HASH_PARALLEL,
            )
        except (ArtifactError, ValueError) as e:
            raise ArtifactRefused(f"weights of artifact {artifact.key} refused: {e}") from None
        finally:
            t.overlapped["weights_verify"] = round(time.monotonic() - started, 4)

    def _place_weights(self, artifact: Artifact, weights: list[CarriedWeights], workload: Workload) -> None:
        seen_ctl = _control_dir_seen_by_worker(self.runtime.name, workload)
        try:
            for w in weights:
                target = host_path(
                    w.worker_path, seen_ctl, workload.control_dir, containerized=self.runtime.name == "runc"
                )
                place_weights(artifact.path / w.file, target, w)
        except (WeightsPlacementError, OSError) as e:
            raise AgentError(f"cannot put the weights back: {e}") from None

    async def _check_gpu_memory(self, extra: dict[str, JsonValue], gpus: GpuInfo | None) -> None:
        """Refuse before anything starts when the GPUs cannot hold what the worker had at checkpoint."""
        need = extra.get("gpuMemory")
        if gpus is None or self.cuda is None or not isinstance(need, dict):
            return
        held, released = need.get("heldMiB"), need.get("releasedMiB")
        if not isinstance(held, int) or not isinstance(released, int):
            return
        try:
            free = [g.memory_free_mib for g in await asyncio.to_thread(list_gpus)][: gpus.count]
        except CudaError as e:
            log.warning("cannot read free GPU memory; restoring anyway", extra={"error": str(e)})
            return
        problem = gpu_memory_problem(free, held, released)
        if problem:
            raise AgentError(problem)

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


def _check_digest(artifact: Artifact, expected: str | None) -> None:
    """``ArtifactRefused`` unless the artifact's sealed manifest has the digest the checkpoint recorded."""
    if expected is not None and artifact.manifest.digest != expected:
        raise ArtifactRefused(
            f"artifact {artifact.key} is not the one checkpoint recorded "
            f"(manifest digest {artifact.manifest.digest or 'none'}, expected {expected})"
        )


@dataclass(frozen=True)
class _Greeting:
    """What a restored worker is told: restore-complete's identity, and restore-context.json's env."""

    identity: dict[str, Any]
    env: Mapping[str, str] | None


def _ensure_restore_context(control_dir: Path, env: Mapping[str, str]) -> None:
    """restore-context.json for a Dynamo worker, from the restore container's env, unless its standby
    entrypoint wrote one (it saw the env as Kubernetes resolved it: Secrets, the Downward API)."""
    path = control_dir / protocol.FILE_RESTORE_CONTEXT
    if path.exists():
        return
    context = {"env": {name: env.get(name) for name in sorted(protocol.RESTORE_CONTEXT_ENV_NAMES)}}
    _write_atomic(path, json.dumps(context, sort_keys=True))


def _check_image(artifact: Artifact, image_id: str | None) -> None:
    """The process tree and its writable layer expect the image they were taken from underneath."""
    recorded = artifact.manifest.extra.get("image")
    if image_id and isinstance(recorded, str) and recorded and recorded != image_id:
        raise AgentError(
            f"image differs: the checkpoint was taken from image {recorded}, this container runs {image_id}"
        )


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


async def _weights_verdict(check: asyncio.Task[TreeStats], verdict: Path | None, t: Timings) -> int:
    """The bytes the weights check read, once it passed; then `verdict` (weights-verified) written."""
    with t.phase("restore", "weights_wait"):
        checked = (await check).bytes
    if verdict is not None:
        await asyncio.to_thread(_write_atomic, verdict, "{}")
    return checked


async def _drop_zero_pages(images: Path) -> SparseStats | None:
    """criu.sparse.drop_zero_pages in a thread, logged; None (the images as CRIU wrote them) if it cannot
    read them. Cancelled, it stops within a batch of pages and returns only then, so the caller's
    clean-up never races the rewrite."""
    try:
        stats = await _in_thread_stoppable(lambda stop: drop_zero_pages(images, stop))
    except (OSError, ImageFormatError) as e:
        log.warning("zero pages kept: cannot read the CRIU images", extra={"error": str(e)})
        return None
    if stats.skipped:
        log.warning("zero pages kept for some processes", extra={"processes": stats.skipped})
    ZERO_PAGES_DROPPED.inc(stats.bytes_dropped)
    log.info(
        "zero pages dropped from the CRIU images",
        extra={
            "bytes": stats.bytes_dropped,
            "of_bytes": stats.pages_before * PAGE,
            "seconds": round(stats.seconds, 3),
        },
    )
    return stats


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task that may still run, and wait until it has ended."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _discard_staging(staging: asyncio.Task[Path] | None) -> None:
    """A restore failed before CRIU ran on its staged images: stop the unpacking, or remove its result."""
    if staging is None:
        return
    if not staging.done():
        staging.cancel()  # _stage_images removes what it wrote before it returns
    with contextlib.suppress(BaseException):
        staged = await staging
        await asyncio.to_thread(shutil.rmtree, staged, True)


async def _in_thread_stoppable(work: Callable[[threading.Event], T]) -> T:
    """``work(stop)`` in a thread. Cancelled, it sets ``stop`` and returns only once ``work`` has, so the
    caller's clean-up never races it."""
    stop = threading.Event()
    running = asyncio.ensure_future(asyncio.to_thread(work, stop))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(BaseException):
            await running
        raise


async def _compress_pages(images: Path, threads: int) -> PagesPacked:
    """criu.packed.pack_pages in a thread, logged. Cancelled, it stops within a few chunks and returns
    only then (the pages images left whole, each plain or packed)."""
    packed = await _in_thread_stoppable(lambda stop: pack_pages(images, threads=threads, stop=stop))
    if packed.failed:
        log.warning("pages images left uncompressed", extra={"files": packed.failed})
    PAGES_COMPRESSED_SAVED.inc(packed.bytes_before - packed.bytes_after)
    log.info(
        "CRIU pages images compressed",
        extra={
            "files": packed.files,
            "bytes": packed.bytes_before,
            "to_bytes": packed.bytes_after,
            "seconds": round(packed.seconds, 3),
        },
    )
    return packed


def _remove_abandoned(base: Path) -> None:
    """Staging images directories under ``base`` whose agent process is gone (killed mid-restore)."""
    for entry in base.iterdir():
        owner = entry.name.split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not pid_running(int(owner)):
            shutil.rmtree(entry, ignore_errors=True)


def _gpu_memory_held_mib(pids: list[int]) -> int:
    """GPU memory the worker's CUDA processes hold (after their own releases); 0 when NVML cannot say."""
    if not pids:
        return 0
    try:
        used = gpu_memory_by_pid()
    except CudaError as e:
        log.warning("no per-process GPU memory", extra={"error": str(e)})
        return 0
    return sum(used.get(pid, 0) for pid in pids)


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


def _is_pages(rel: str) -> bool:
    # CRIU's memory contents (pages-N.img); the other images describe the tree it rebuilds.
    name = rel.rsplit("/", 1)[-1]
    return name.startswith("pages-") and name.endswith(".img")


def _list(extra: dict[str, JsonValue], key: str) -> list[JsonValue]:
    value = extra.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"manifest extra.{key} is not a list")
    return value


def _control_dir_seen_by_worker(runtime: str, workload: Workload) -> str:
    # Inside a container the worker sees the mount path; a host process sees the host directory.
    if workload.worker_control_dir is not None:
        return workload.worker_control_dir
    return protocol.CONTROL_MOUNT_PATH if runtime == "runc" else str(workload.control_dir)


def assigned_gpus(
    node: GpuInfo | None, visible: tuple[str, ...] | None, checkpoint: GpuInfo | None
) -> GpuInfo | None:
    """The GPUs a restore goes onto: the container's (``visible``: UUIDs, or indices of the node's GPUs)
    where its runtime says, else the node's. AgentError when they cannot hold the checkpoint's."""
    if node is None or visible is None or checkpoint is None:
        return node
    uuids: list[str] = []
    for token in visible:
        if token.isdigit():
            index = int(token)
            if index >= len(node.uuids):
                raise AgentError(
                    f"the restore container was given GPU {index} (NVIDIA_VISIBLE_DEVICES); this node has "
                    f"{len(node.uuids)}"
                )
            uuids.append(node.uuids[index])
        else:
            uuids.append(token)
    if len(uuids) < checkpoint.count:
        raise AgentError(
            f"the restore container was given {len(uuids)} GPU(s) (NVIDIA_VISIBLE_DEVICES); the checkpoint "
            f"was taken on {checkpoint.count}"
        )
    return node.model_copy(update={"uuids": uuids, "count": len(uuids)})


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
