"""The reconcile queue's guarantees, checked as pure logic (no Kubernetes needed)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Hashable

import pytest

from dynamo_snapshot.kube.workqueue import Result, WorkQueue
from tests.kube.helpers import eventually


class Recorder:
    """A reconcile that records calls and tracks concurrency, overall and per key."""

    def __init__(self, body: Callable[[Hashable], Awaitable[Result | None]] | None = None) -> None:
        self.calls: list[Hashable] = []
        self.running: Counter[Hashable] = Counter()
        self.max_running = 0
        self.max_same_key = 0
        self.body = body

    async def __call__(self, key: Hashable) -> Result | None:
        self.calls.append(key)
        self.running[key] += 1
        self.max_same_key = max(self.max_same_key, self.running[key])
        self.max_running = max(self.max_running, sum(self.running.values()))
        try:
            await asyncio.sleep(0)
            return await self.body(key) if self.body else None
        finally:
            self.running[key] -= 1


async def test_duplicates_collapse_and_order_is_fifo() -> None:
    rec = Recorder()
    q: WorkQueue[str] = WorkQueue("t-fifo", rec, workers=1)
    for key in ["a", "b", "a", "c", "b", "a"]:
        q.add(key)
    assert len(q) == 3
    q.start()
    await eventually(lambda: len(rec.calls) == 3)
    await asyncio.sleep(0.05)
    assert rec.calls == ["a", "b", "c"]
    assert await q.shutdown(1)


async def test_key_added_while_processing_runs_once_more_never_concurrently() -> None:
    release = asyncio.Event()

    async def slow(key: Hashable) -> None:
        if len(rec.calls) == 1:
            await release.wait()

    rec = Recorder(slow)
    q: WorkQueue[str] = WorkQueue("t-serial", rec, workers=4)
    q.start()
    q.add("k")
    await eventually(lambda: rec.running["k"] == 1)
    for _ in range(5):  # idle workers must not pick it up while it runs, and repeats collapse
        q.add("k")
    await asyncio.sleep(0.05)
    assert rec.calls == ["k"]
    release.set()
    await eventually(lambda: len(rec.calls) == 2)
    await asyncio.sleep(0.05)
    assert rec.calls == ["k", "k"]
    assert rec.max_same_key == 1
    assert await q.shutdown(1)


async def test_concurrency_is_bounded_by_workers() -> None:
    gate = asyncio.Event()

    async def block(key: Hashable) -> None:
        await gate.wait()

    rec = Recorder(block)
    q: WorkQueue[int] = WorkQueue("t-bound", rec, workers=3)
    q.start()
    for i in range(10):
        q.add(i)
    await eventually(lambda: len(rec.calls) == 3)
    await asyncio.sleep(0.05)
    assert len(rec.calls) == 3
    assert len(q) == 7
    gate.set()
    await eventually(lambda: len(rec.calls) == 10)
    assert rec.max_running == 3
    assert await q.shutdown(1)


def test_backoff_doubles_from_base_to_cap() -> None:
    q: WorkQueue[str] = WorkQueue("t-backoff", Recorder())
    assert [q.backoff(n) for n in range(10)] == [0.25, 0.5, 1, 2, 4, 8, 16, 32, 60, 60]
    assert q.backoff(10_000) == 60


async def test_failures_back_off_then_forget_resets() -> None:
    starts: list[float] = []

    async def flaky(key: Hashable) -> None:
        starts.append(time.monotonic())
        if len(starts) <= 4:
            raise RuntimeError("apiserver said no")

    q: WorkQueue[str] = WorkQueue("t-flaky", Recorder(flaky), workers=2, base_delay=0.02, max_delay=1)
    q.start()
    q.add("k")
    await eventually(lambda: len(starts) == 5)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 0.02, 0.04, 0.08, 0.16: each retry waits at least its doubled backoff
    for i, gap in enumerate(gaps):
        assert gap >= 0.02 * 2**i * 0.9, gaps
    await asyncio.sleep(0.02)
    assert q.num_requeues("k") == 0, "success must forget the key's failures"
    q.add_rate_limited("x")
    q.add_rate_limited("x")
    assert q.num_requeues("x") == 2
    q.forget("x")
    assert q.num_requeues("x") == 0
    assert await q.shutdown(1)


async def test_exception_is_logged_with_key(caplog: pytest.LogCaptureFixture) -> None:
    async def boom(key: Hashable) -> None:
        raise ValueError("bad spec")

    q: WorkQueue[tuple[str, str]] = WorkQueue("t-log", Recorder(boom), base_delay=10)
    q.start()
    with caplog.at_level(logging.ERROR, logger="dynamo_snapshot.kube.workqueue"):
        q.add(("DynamoGraphDeployment", "ns/a"))
        await eventually(lambda: any(r.message == "reconcile failed" for r in caplog.records))
    rec = next(r for r in caplog.records if r.message == "reconcile failed")
    assert rec.__dict__["key"] == ("DynamoGraphDeployment", "ns/a")
    assert rec.exc_info is not None
    assert "bad spec" in str(rec.exc_info[1])
    assert await q.shutdown(1)


async def test_result_requeue_after_and_add_after_earliest_wins() -> None:
    async def again(key: Hashable) -> Result | None:
        return Result(requeue_after=0.05) if key == "poll" and rec.calls.count("poll") < 3 else None

    rec = Recorder(again)
    q: WorkQueue[str] = WorkQueue("t-after", rec, workers=2)
    q.start()
    q.add("poll")
    await eventually(lambda: rec.calls.count("poll") == 3)

    t0 = time.monotonic()
    q.add_after("d", 30)
    q.add_after("d", 0.02)  # earlier deadline replaces the later one
    q.add_after("d", 20)  # later deadline is ignored
    await eventually(lambda: "d" in rec.calls, within=2)
    assert time.monotonic() - t0 < 2
    await asyncio.sleep(0.05)
    assert rec.calls.count("d") == 1
    assert await q.shutdown(1)


async def test_resync_adds_all_keys_periodically() -> None:
    rec = Recorder()
    q: WorkQueue[str] = WorkQueue("t-resync", rec, workers=2)
    q.start()
    q.resync(lambda: ["a", "b"], period=0.03)
    await eventually(lambda: rec.calls.count("a") >= 3 and rec.calls.count("b") >= 3)
    assert await q.shutdown(1)
    n = len(rec.calls)
    await asyncio.sleep(0.1)
    assert len(rec.calls) == n, "resync must stop at shutdown"


async def test_shutdown_waits_for_in_flight_and_takes_no_new_keys() -> None:
    finished: list[str] = []

    async def write(key: Hashable) -> None:
        await asyncio.sleep(0.2)  # an in-flight apiserver write
        finished.append(str(key))

    rec = Recorder(write)
    q: WorkQueue[str] = WorkQueue("t-drain", rec, workers=2)
    q.start()
    for key in ["a", "b", "c", "d"]:
        q.add(key)
    q.add_after("later", 0.05)
    await eventually(lambda: len(rec.calls) == 2)
    drained = await q.shutdown(drain_timeout=5)
    assert drained
    assert sorted(finished) == ["a", "b"], "in-flight reconciles finish; queued ones are not started"
    q.add("e")
    await asyncio.sleep(0.1)
    assert rec.calls == ["a", "b"]


async def test_shutdown_cancels_reconciles_past_the_deadline() -> None:
    cancelled = asyncio.Event()

    async def stuck(key: Hashable) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    rec = Recorder(stuck)
    q: WorkQueue[str] = WorkQueue("t-stuck", rec, workers=1)
    q.start()
    q.add("k")
    await eventually(lambda: rec.running["k"] == 1)
    assert not await q.shutdown(drain_timeout=0.05)
    assert cancelled.is_set()


async def test_no_update_is_lost_under_random_load() -> None:
    """Every add is followed by a reconcile that starts after it, and no key ever runs twice at once."""
    version: Counter[int] = Counter()
    seen_at_start: defaultdict[int, int] = defaultdict(int)
    rng = random.Random(7)

    async def work(key: Hashable) -> None:
        assert isinstance(key, int)
        seen_at_start[key] = version[key]
        await asyncio.sleep(rng.random() * 0.003)
        if rng.random() < 0.1:
            raise RuntimeError("transient")

    rec = Recorder(work)
    q: WorkQueue[int] = WorkQueue("t-random", rec, workers=5, base_delay=0.001, max_delay=0.01)
    q.start()

    async def producer() -> None:
        for _ in range(300):
            key = rng.randrange(12)
            version[key] += 1
            q.add(key)
            await asyncio.sleep(rng.random() * 0.002)

    await asyncio.gather(*(producer() for _ in range(4)))
    await eventually(lambda: all(seen_at_start[k] == v for k, v in version.items()), within=10)
    assert rec.max_same_key == 1
    assert rec.max_running <= 5
    assert await q.shutdown(1)
