"""The reconcile queue: client-go's rate-limited delaying workqueue with its workers built in.

Invariants (the reason this exists instead of an asyncio.Queue):
* a key waits in the queue at most once, however often it is added (``dirty``);
* a key is reconciled by at most one worker at a time (``processing``); a key added while it is being
  reconciled runs once more afterwards, so no change is lost and no two writes race;
* keys are handed out in FIFO order, so a hot key cannot starve the others.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

DEPTH = Gauge("dynsnap_workqueue_depth", "Keys waiting to be reconciled", ["queue"])
INFLIGHT = Gauge("dynsnap_workqueue_inflight", "Keys being reconciled now", ["queue"])
ADDS = Counter("dynsnap_workqueue_adds_total", "Keys added (before de-duplication)", ["queue"])
RETRIES = Counter("dynsnap_workqueue_retries_total", "Rate-limited re-adds", ["queue"])
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
QUEUE_DURATION = Histogram(
    "dynsnap_workqueue_queue_duration_seconds",
    "Time a key waited before a worker took it",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
WORK_DURATION = Histogram(
    "dynsnap_workqueue_work_duration_seconds",
    "Time a worker spent on a key",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
RECONCILE_DURATION = Histogram(
    "dynsnap_reconcile_duration_seconds",
    "Reconcile duration by kind and outcome",
    ["kind", "outcome"],
    buckets=_LATENCY_BUCKETS,
)
RECONCILE_ERRORS = Counter("dynsnap_reconcile_errors_total", "Reconciles that raised", ["kind"])


@dataclass(frozen=True, slots=True)
class Result:
    """What a reconcile asks for next: nothing (done), a rate-limited retry, or a run after a delay."""

    requeue: bool = False
    requeue_after: float | None = None


Reconciler = Callable[[K], Awaitable[Result | None]]


def default_kind_of(key: Hashable) -> str:
    """Keys shaped ("Kind", "ns/name") report metrics by their kind."""
    if isinstance(key, tuple) and key and isinstance(key[0], str):
        return key[0]
    return type(key).__name__


class WorkQueue(Generic[K]):
    """Run ``reconcile(key)`` on up to ``workers`` keys at once, each key serialized."""

    def __init__(
        self,
        name: str,
        reconcile: Reconciler[K],
        *,
        workers: int = 4,
        base_delay: float = 0.25,
        max_delay: float = 60.0,
        kind_of: Callable[[K], str] = default_kind_of,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.name = name
        self.reconcile = reconcile
        self.workers = workers
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.kind_of = kind_of
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._added_at: dict[K, float] = {}
        self._failures: dict[K, int] = {}
        self._delayed: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._resyncs: list[asyncio.Task[None]] = []
        self._shutting_down = False

    # ------------------------------------------------------------------ adding keys
    def add(self, key: K) -> None:
        if self._shutting_down:
            return
        ADDS.labels(self.name).inc()
        if key in self._dirty:
            return
        self._dirty.add(key)
        self._added_at.setdefault(key, time.monotonic())
        if key in self._processing:
            return  # done() queues it again once the running reconcile finishes
        self._queue.append(key)
        DEPTH.labels(self.name).set(len(self._queue))
        self._notify()

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` after ``delay`` seconds; of several pending delays for a key the earliest wins."""
        if self._shutting_down:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._delayed.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        self._delayed[key] = (due, loop.call_at(due, self._fire_delayed, key))

    def _fire_delayed(self, key: K) -> None:
        self._delayed.pop(key, None)
        self.add(key)

    def add_rate_limited(self, key: K) -> None:
        """Add after this key's backoff: base_delay doubling per failure up to max_delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        RETRIES.labels(self.name).inc()
        self.add_after(key, self.backoff(failures))

    def backoff(self, failures: int) -> float:
        # Capping the exponent first keeps 2**n from overflowing a float for a key that fails for days.
        return min(self.max_delay, self.base_delay * 2.0 ** min(failures, 64))

    def forget(self, key: K) -> None:
        """Reset the key's backoff (after a successful reconcile)."""
        self._failures.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)

    def __len__(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ handing keys out
    def _notify(self, all_waiters: bool = False) -> None:
        # Plain futures rather than asyncio.Condition: add() stays synchronous (callable from informer
        # handlers and timer callbacks) and wakes exactly one idle worker.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if not all_waiters:
                    return

    async def _get(self) -> K | None:
        """The next key, or None once shutting down (queued keys are then left for the next leader)."""
        while not self._queue and not self._shutting_down:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                # Pass a wake-up this worker swallowed on to another one.
                if waiter.done() and not waiter.cancelled():
                    self._notify()
                raise
        if self._shutting_down:
            return None
        key = self._queue.popleft()
        DEPTH.labels(self.name).set(len(self._queue))
        self._processing.add(key)
        self._dirty.discard(key)
        INFLIGHT.labels(self.name).set(len(self._processing))
        if (added := self._added_at.pop(key, None)) is not None:
            QUEUE_DURATION.labels(self.name).observe(time.monotonic() - added)
        return key

    def _done(self, key: K) -> None:
        self._processing.discard(key)
        INFLIGHT.labels(self.name).set(len(self._processing))
        if key in self._dirty and not self._shutting_down:
            self._queue.append(key)
            DEPTH.labels(self.name).set(len(self._queue))
            self._notify()

    # ------------------------------------------------------------------ workers
    def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"workqueue-{self.name}-{i}")
            for i in range(self.workers)
        ]

    async def _worker(self) -> None:
        while (key := await self._get()) is not None:
            try:
                await self._process(key)
            finally:
                self._done(key)

    async def _process(self, key: K) -> None:
        kind = self.kind_of(key)
        started = time.monotonic()
        outcome = "success"
        try:
            result = await self.reconcile(key)
        except Exception:
            outcome = "error"
            RECONCILE_ERRORS.labels(kind).inc()
            log.exception(
                "reconcile failed", extra={"queue": self.name, "key": key, "retries": self.num_requeues(key)}
            )
            self.add_rate_limited(key)
        else:
            if result is not None and result.requeue_after is not None:
                outcome = "requeue_after"
                self.forget(key)
                self.add_after(key, result.requeue_after)
            elif result is not None and result.requeue:
                outcome = "requeue"
                self.add_rate_limited(key)
            else:
                self.forget(key)
        finally:
            elapsed = time.monotonic() - started
            WORK_DURATION.labels(self.name).observe(elapsed)
            RECONCILE_DURATION.labels(kind, outcome).observe(elapsed)

    def resync(
        self, keys_fn: Callable[[], Iterable[K]], period: float, jitter: float = 0.1
    ) -> asyncio.Task[None]:
        """Every ``period`` (± jitter) seconds add every key ``keys_fn`` returns; stops at shutdown."""

        async def loop() -> None:
            while not self._shutting_down:
                await asyncio.sleep(period * random.uniform(1 - jitter, 1 + jitter))
                try:
                    keys = list(keys_fn())
                except Exception:
                    log.exception("resync key listing failed", extra={"queue": self.name})
                    continue
                for key in keys:
                    self.add(key)
                log.debug("resync", extra={"queue": self.name, "keys": len(keys)})

        task = asyncio.create_task(loop(), name=f"workqueue-{self.name}-resync")
        self._resyncs.append(task)
        return task

    async def shutdown(self, drain_timeout: float = 30.0) -> bool:
        """Stop taking keys, let in-flight reconciles finish (up to ``drain_timeout``), stop the workers.

        Returns False if reconciles had to be cancelled at the deadline.
        """
        self._shutting_down = True
        for _, handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        for task in self._resyncs:
            task.cancel()
        self._notify(all_waiters=True)
        drained = True
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout)
            if pending:
                drained = False
                log.warning(
                    "cancelling reconciles still running at the drain deadline",
                    extra={"queue": self.name, "keys": [repr(k) for k in self._processing]},
                )
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)
        await asyncio.gather(*self._resyncs, return_exceptions=True)
        self._tasks, self._resyncs = [], []
        DEPTH.labels(self.name).set(0)
        return drained
