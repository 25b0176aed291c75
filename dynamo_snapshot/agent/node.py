"""What checkpoints and restores on this node work with: its runtime, CRIU, CUDA, GPUs and artifact store,
and the settings that shape both procedures."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.gpu_assignment import local_gpus
from dynamo_snapshot.agent.page_images import remove_abandoned
from dynamo_snapshot.agent.runtime.base import Runtime, Workload
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore, GpuInfo, VerifiedFiles, warm_up_hashing
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.criu.packed import DEFAULT_THREADS
from dynamo_snapshot.cuda import CudaCheckpointer, cuda_available
from dynamo_snapshot.fileio import TreeStats

__all__ = ["DEFAULT_RESTORE_SCRATCH", "Node"]

# Where a restore unpacks compressed pages for CRIU: a tmpfs, so CRIU reads them at memory speed.
DEFAULT_RESTORE_SCRATCH = Path("/dev/shm/dynamo-snapshot")


class Node:
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
        weights_check_early: bool = True,
        weights_check_parallel: int | None = None,
        drop_zero_pages: bool = False,
        compress_pages: bool = False,
        restore_scratch: Path | None = DEFAULT_RESTORE_SCRATCH,
        pages_threads: int | None = None,
        cache: ArtifactCache | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.criu = criu
        self.node_name = node_name
        self.cuda = cuda if cuda is not None else (CudaCheckpointer() if cuda_available() else None)
        self.gpus = gpus if gpus is not None else local_gpus()
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
        # At idle priority, start the weights check with the check of the process images rather than
        # after it. On the H200 (mq-deadline) after it was no faster: 8g 6.31 vs 5.84/6.34 s, 1g 4.65
        # vs 4.07/4.12 s (BENCHMARKS.md).
        self.weights_check_early = weights_check_early
        # Leave the zero pages of anonymous memory out of the CRIU images (see criu.sparse).
        self.drop_zero_pages = drop_zero_pages
        # Store the pages images compressed (see criu.packed); a restore unpacks them into a staging
        # images directory under restore_scratch (None, or unusable: beside the workload's control dir).
        self.compress_pages = compress_pages
        self.restore_scratch = restore_scratch
        self.pages_threads = pages_threads or DEFAULT_THREADS
        # Scratch bases already rid of the staging of agent processes that died mid-restore.
        self.scratch_cleaned: set[Path] = set()
        # Threads of the weights check beside CRIU (None: the artifact default, twice the cores).
        self.weights_check_parallel = weights_check_parallel
        # The checks of artifact files under way, per artifact directory and files (shared_check).
        self.checks: dict[tuple[str, tuple[str, ...]], asyncio.Task[TreeStats]] = {}
        # A node-local copy of the store's artifacts (None: every restore reads the store), and the
        # copies into it under way, per artifact key.
        self.cache = cache
        self.fills: dict[str, asyncio.Task[None]] = {}
        # Restores under way per artifact key, and keys being deleted: an artifact is deleted only while
        # no restore reads it, and no restore starts on what is being removed.
        self.reading: collections.Counter[str] = collections.Counter()
        # Checks of artifacts begun ahead of their restores (Executor.check_ahead), held until they end.
        self.checks_ahead: set[asyncio.Task[None]] = set()
        self.deleting: collections.Counter[str] = collections.Counter()
        # Big files are hashed in a helper process (see artifact.isolated); start it before it is needed.
        warm_up_hashing()

    def shared_check(
        self, artifact_dir: Path, files: list[str], check: Callable[[], Coroutine[Any, Any, TreeStats]]
    ) -> tuple[asyncio.Task[TreeStats], bool]:
        """The check of ``files`` of the artifact in ``artifact_dir`` under way, or ``check()`` started as
        it: every restore that wants those files checked meanwhile awaits the one task (shielded: one
        giving up does not end it for the others), so a burst of restores reads and hashes them once.
        True when this call started it (its caller counts the bytes; joiners count none)."""
        key = (str(artifact_dir), tuple(files))
        running = self.checks.get(key)
        if running is not None:
            return running, False
        task = asyncio.create_task(check())
        self.checks[key] = task

        def ended(done: asyncio.Task[TreeStats]) -> None:
            self.checks.pop(key, None)
            if not done.cancelled():
                done.exception()  # every waiter gets it; retrieved here in case every one gave up

        task.add_done_callback(ended)
        return task, True

    async def remove_abandoned_scratch(self) -> None:
        """The restore staging of agent processes that died mid-restore, removed when this one starts:
        the scratch is a tmpfs by default, so what they left holds node memory until then."""
        base = self.restore_scratch
        if base is None or not await asyncio.to_thread(base.is_dir):
            return
        await asyncio.to_thread(remove_abandoned, base)
        self.scratch_cleaned.add(base)

    @property
    def host_processes(self) -> bool:
        """Whether the workers are processes of the host itself (the ``local`` runtime), not containers:
        only theirs may name files outside their control directory."""
        return self.runtime.name == "local"

    def control_dir_seen_by_worker(self, workload: Workload) -> str:
        # Inside a container the worker sees the mount path; a host process sees the host directory.
        if workload.worker_control_dir is not None:
            return workload.worker_control_dir
        return protocol.CONTROL_MOUNT_PATH if self.runtime.name == "runc" else str(workload.control_dir)
