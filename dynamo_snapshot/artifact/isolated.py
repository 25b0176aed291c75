"""Bulk hashing in a helper process, so that it cannot starve the agent's event loop.

``hash_files`` keeps two threads per core busy in ``pread`` and ``hashlib``; each call drops the GIL
and takes it back, thousands of times a second. An event loop in the same process must win the GIL
for every step it takes, and against 32 such threads it waits behind them: on the H200 the loop woke
up to 1.24 s late while the weights were checked beside CRIU, and CRIU (spawned from that loop) started
3-4 s after it was asked to (BENCHMARKS.md, "The CRIU phase"). In a helper process the threads
contend for that process's GIL and the caller's loop runs freely; throughput is the same, the disk
being the limit.

Small jobs stay in the calling process: a helper's start (spawning Python) would cost more than the
hashing. The helpers are spawned, not forked (forking a process that has threads and an event loop
copies locks in whatever state they are in); ``warm_up`` starts one ahead of the first restore.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from dynamo_snapshot.fileio import HASH_PARALLEL, FileDigests, HashJob, hash_files

__all__ = ["ISOLATE_MIN_BYTES", "hash_files_isolated", "helper_pid", "shutdown", "warm_up"]

log = logging.getLogger(__name__)

# Below this the jobs are hashed in the caller's threads: a few hundred milliseconds of hashing do not
# starve anything, and a cold helper costs about that to start.
ISOLATE_MIN_BYTES = 256 << 20
# Concurrent bulk checks (restores of different checkpoints on one node) each get a helper.
_HELPERS = 4

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def _exit_with(parent: int) -> None:
    """In each helper: exit once the process that started it is gone. A helper waits on a pipe its
    pool's own queue keeps open, so an agent killed outright would otherwise leave it behind forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                max_workers=_HELPERS,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with,
                initargs=(os.getpid(),),
            )
        return _pool


def _drop_pool(broken: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


def _helper_died(pool: ProcessPoolExecutor | None) -> None:
    # Killed, or out of memory: the next call gets a fresh pool; this one hashes in the caller.
    log.warning("a hashing helper died; hashing in-process this time")
    if pool is not None:
        _drop_pool(pool)


def helper_pid() -> int:
    """The pid a helper runs as (for tests: it is not the caller's)."""
    return os.getpid()


def warm_up() -> Future[int] | None:
    """Start a helper now, so the first bulk check does not wait for Python to start; None (and a
    warning) where helpers cannot be started: hashing then stays in the caller's threads."""
    try:
        return _get_pool().submit(helper_pid)
    except (OSError, RuntimeError) as e:
        log.warning("cannot start a hashing helper; hashing in-process", extra={"error": str(e)})
        return None


def shutdown() -> None:
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


atexit.register(shutdown)


def hash_files_isolated(
    jobs: Sequence[HashJob],
    *,
    parallel: int = HASH_PARALLEL,
    direct: bool = False,
    fsync: bool = False,
    idle_io: bool = False,
    min_bytes: int = ISOLATE_MIN_BYTES,
) -> list[FileDigests]:
    """``hash_files``, in a helper process once the jobs hold ``min_bytes`` or more; same results, same
    errors (an ``OSError`` or ``ValueError`` raised there is raised here)."""
    kwargs: dict[str, Any] = {"parallel": parallel, "direct": direct, "fsync": fsync, "idle_io": idle_io}
    if sum(job.size for job in jobs) < min_bytes:
        return hash_files(jobs, **kwargs)
    pool: ProcessPoolExecutor | None = None
    try:
        pool = _get_pool()
        future = pool.submit(hash_files, list(jobs), **kwargs)
    except BrokenProcessPool:
        _helper_died(pool)
    except (OSError, RuntimeError) as e:  # no helper can start, or the interpreter is exiting
        log.warning("hashing in-process: no helper", extra={"error": str(e)})
    else:
        try:
            # Errors of the hashing itself (a missing file) come out of result() as they are.
            return future.result()
        except BrokenProcessPool:
            _helper_died(pool)
    return hash_files(jobs, **kwargs)
