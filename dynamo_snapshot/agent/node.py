"""What checkpoints and restores on this node work with: its runtime, CRIU, CUDA, GPUs and artifact store,
and the settings that shape both procedures."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.artifact_fetch import NodeFetch
from dynamo_snapshot.agent.config import DEFAULT_RESTORE_SCRATCH, AgentConfig
from dynamo_snapshot.agent.gpu_assignment import local_gpus
from dynamo_snapshot.agent.metrics import CACHE_EVICTIONS
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.page_images import remove_abandoned
from dynamo_snapshot.agent.runtime.base import Runtime, Workload
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import (
    ArtifactCache,
    ArtifactStore,
    GpuInfo,
    VerifiedFiles,
    warm_up_hashing,
)
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.criu.packed import DEFAULT_THREADS
from dynamo_snapshot.cuda import CudaCheckpointer, cuda_available
from dynamo_snapshot.fileio import TreeStats

__all__ = ["DEFAULT_RESTORE_SCRATCH", "Node"]


class Node:
    # Lock timeout of the CUDA checkpoint API, and threads that compress and unpack pages images.
    cuda_lock_timeout_ms = 10_000
    pages_threads = DEFAULT_THREADS

    def __init__(
        self,
        runtime: Runtime,
        store: ArtifactStore,
        criu: Criu,
        config: AgentConfig,
        *,
        cuda: CudaCheckpointer | None = None,
        gpus: GpuInfo | None = None,
        cache: ArtifactCache | None = None,
        objects: ObjectStore | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.criu = criu
        # The settings checkpoints and restores read (config.checkpoint, config.restore) as they start.
        self.config = config
        self.node_name = config.node.node_name
        self.cuda = cuda if cuda is not None else (CudaCheckpointer() if cuda_available() else None)
        self.gpus = gpus if gpus is not None else local_gpus()
        # Restores 2..N of one checkpoint on this node skip hashing files verified unchanged (0: never).
        ttl = config.store.verify_cache_seconds
        self.verified = VerifiedFiles(ttl_s=ttl) if ttl > 0 else None
        # Scratch bases already rid of the staging of agent processes that died mid-restore.
        self.scratch_cleaned: set[Path] = set()
        # The checks of artifact files under way, per artifact directory and files (shared_check).
        self.checks: dict[tuple[str, tuple[str, ...]], asyncio.Task[TreeStats]] = {}
        # A node-local copy of the store's artifacts (None: every restore reads the store), and the
        # copies into it under way, per artifact key.
        self.cache = cache
        if cache is not None:
            cache.on_evicted = lambda keys: CACHE_EVICTIONS.inc(len(keys))
        # An object store every checkpoint is written to and restores fetch from where ``store`` lacks
        # the artifact (None: ``store`` is the only one).
        self.objects = objects
        # Fetches from it under way, per artifact key; fetches ahead of any restore go one at a time.
        self.fetching: dict[str, NodeFetch] = {}
        self.fetch_ahead_gate = asyncio.Semaphore(1)
        self.fills: dict[str, asyncio.Task[None]] = {}
        # Restores under way per artifact key, and keys being deleted: an artifact is deleted only while
        # no restore reads it, and no restore starts on what is being removed.
        self.reading: collections.Counter[str] = collections.Counter()
        # Checks of artifacts begun ahead of their restores (Executor.check_ahead), held until they end.
        self.checks_ahead: set[asyncio.Task[None]] = set()
        # Restored trees whose memory pages still stream in (agent/pages_stream.py), until all moved.
        self.page_streams: set[asyncio.Task[None]] = set()
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
        base = self.config.restore.restore_scratch
        if not await asyncio.to_thread(base.is_dir):
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
