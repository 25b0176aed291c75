"""The demo follows the cluster through watch events: what its handlers record, and its waits, which wake
on a change (not on a timer) and give up at their deadline. No cluster: events are fed to the handlers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import ADDED, DELETED, MODIFIED, Obj
from dynamo_snapshot_dev.demo.scenario import SERVICE, Profile, Scenario
from dynamo_snapshot_dev.demo.stack import DemoError


class FakeStack(SimpleNamespace):
    def __init__(self, workdir: Path) -> None:
        super().__init__(kube=object(), workers={}, endpoint_dir=workdir, forgotten=[])

    def forget_endpoint(self, pod: str) -> None:
        self.forgotten.append(pod)


@pytest.fixture
def scenario(tmp_path: Path) -> Scenario:
    stack: Any = FakeStack(tmp_path)
    return Scenario(stack, Profile.quick(), lambda _: None)


def _pod(name: str, *, mode: str = "restore", node: str = "gpu-node-0", **meta: Any) -> Obj:
    labels = {protocol.LABEL_START_MODE: mode}
    return {"metadata": {"name": name, "labels": labels, **meta}, "spec": {"nodeName": node}}


def _dgd(replicas: int) -> Obj:
    return {"metadata": {"name": "demo"}, "spec": {"services": {SERVICE: {"replicas": replicas}}}}


async def test_pod_events_are_recorded_and_a_deleted_pod_is_gone(scenario: Scenario) -> None:
    timings = '{"criu_restore": 0.25}'
    await scenario._on_pod(ADDED, _pod("p1", node=""), None)
    await scenario._on_pod(
        MODIFIED, _pod("p1", annotations={protocol.ANNOTATION_RESTORE_TIMINGS: timings}), None
    )
    rec = scenario.pods["p1"]
    assert (rec.mode, rec.node, rec.restore_timings, rec.gone) == (
        "restore",
        "gpu-node-0",
        {"criu_restore": 0.25},
        None,
    )
    await scenario._on_pod(MODIFIED, _pod("p1", deletionTimestamp="2025-01-01T00:00:00Z"), None)
    assert rec.gone is not None
    await scenario._on_pod(DELETED, _pod("p1"), None)
    stack: Any = scenario.stack
    assert stack.forgotten == ["p1"], "its endpoint is forgotten once"
    await scenario._on_pod(DELETED, _pod("never-seen"), None)
    assert "never-seen" not in scenario.pods


async def test_a_wait_wakes_on_the_event_that_answers_it(scenario: Scenario) -> None:
    async def scale_later() -> None:
        await asyncio.sleep(0.05)
        await scenario._on_dgd(ADDED, _dgd(1), None)
        await asyncio.sleep(0.05)
        await scenario._on_dgd(MODIFIED, _dgd(3), None)

    feeder = asyncio.create_task(scale_later())
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await scenario._until("a scale-up", lambda: scenario.desired if scenario.desired > 1 else None, 5)
    assert got == 3
    assert loop.time() - started < 1
    await feeder


async def test_a_wait_gives_up_at_its_deadline(scenario: Scenario) -> None:
    with pytest.raises(DemoError, match="timed out after 0s waiting for nothing"):
        await scenario._until("nothing", lambda: None, 0.1)


async def test_a_wait_ends_when_the_follower_dies(scenario: Scenario) -> None:
    async def broken() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("probe crashed")

    scenario._follower = asyncio.create_task(broken())
    scenario._follower.add_done_callback(lambda _: scenario._changes.notify())
    with pytest.raises(RuntimeError, match="probe crashed"):
        await scenario._until("nothing", lambda: None, 5)
