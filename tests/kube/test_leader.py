"""Leader election on a real Lease: one leader at a time, fast handover on release, loss detection."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamo_snapshot.kube.kube import LEASE, Kube
from dynamo_snapshot.kube.leader import LeaderElector
from tests.kube.helpers import eventually

pytestmark = pytest.mark.cluster

FAST = {"lease_duration": 4.0, "renew_deadline": 2.0, "retry_period": 0.2}


def elector(kube: Kube, namespace: str, identity: str) -> LeaderElector:
    return LeaderElector(kube, name="ctrl", namespace=namespace, identity=identity, **FAST)


async def test_only_one_leads_and_release_hands_over_at_once(kube: Kube, namespace: str) -> None:
    a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
    async with a:
        assert a.is_leader
        b_task = asyncio.create_task(b.__aenter__())
        await asyncio.sleep(1.0)  # several of b's retry periods, a keeps renewing
        assert not b_task.done(), "b must not lead while a holds the lease"
        assert not await b.try_acquire_or_renew()
        assert b.observed_holder == "a"
        lease = await kube.get(LEASE, "ctrl", namespace)
        assert lease["spec"]["holderIdentity"] == "a"
        released_at = time.monotonic()
    # a released on exit: b takes over within a retry period or two, not after the 4 s lease duration
    async with asyncio.timeout(3):
        await b_task
    assert time.monotonic() - released_at < 2.0
    assert b.is_leader
    assert not a.is_leader
    lease = await kube.get(LEASE, "ctrl", namespace)
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    await b.__aexit__(None, None, None)
    lease = await kube.get(LEASE, "ctrl", namespace)
    assert not lease["spec"].get("holderIdentity")


async def test_crashed_leader_is_replaced_after_lease_duration(kube: Kube, namespace: str) -> None:
    a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
    await a.acquire()  # acquired, but never renewed or released: a crash
    started = time.monotonic()
    async with asyncio.timeout(15):
        await b.acquire()
    waited = time.monotonic() - started
    assert FAST["lease_duration"] * 0.9 <= waited < FAST["lease_duration"] + 3
    lease = await kube.get(LEASE, "ctrl", namespace)
    assert lease["spec"]["holderIdentity"] == "b"


async def test_leader_notices_a_stolen_lease(kube: Kube, namespace: str) -> None:
    a = elector(kube, namespace, "a")
    async with a:
        lease = await kube.get(LEASE, "ctrl", namespace)
        lease["spec"]["holderIdentity"] = "intruder"
        lease["spec"]["leaseDurationSeconds"] = 60
        await kube.replace(LEASE, lease)
        async with asyncio.timeout(5):
            await a.lost.wait()
        assert not a.is_leader
    lease = await kube.get(LEASE, "ctrl", namespace)
    assert lease["spec"]["holderIdentity"] == "intruder", "a loser must not release someone else's lease"


async def test_run_finishes_work_before_handing_over(kube: Kube, namespace: str) -> None:
    a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
    log: list[str] = []

    async def lead() -> None:
        log.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # in-flight writes finish (what the workqueue drain does)
            holder = (await kube.get(LEASE, "ctrl", namespace))["spec"]["holderIdentity"]
            log.append(f"drained while holder={holder}")
            raise

    async def stopped() -> None:
        log.append("stopped")

    run = asyncio.create_task(a.run(lead, stopped))
    await eventually(lambda: log == ["started"], what="a leading")
    run.cancel()  # SIGTERM
    with pytest.raises(asyncio.CancelledError):
        await run
    assert log == ["started", "drained while holder=a", "stopped"]
    async with asyncio.timeout(2):
        await b.acquire()
    await b.release()


async def test_run_returns_when_the_work_returns(kube: Kube, namespace: str) -> None:
    a = elector(kube, namespace, "a")
    done: list[bool] = []

    async def lead() -> None:
        done.append(a.is_leader)

    async with asyncio.timeout(5):
        await a.run(lead)
    assert done == [True]
    assert not (await kube.get(LEASE, "ctrl", namespace))["spec"].get("holderIdentity")


def test_rejects_inconsistent_timings(kube: Kube) -> None:
    with pytest.raises(ValueError, match="lease_duration"):
        LeaderElector(kube, name="x", namespace="y", lease_duration=5, renew_deadline=10, retry_period=2)
