"""Slow-start batching: pure logic, so a fake create is the real thing here."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_snapshot.controller.dynamo.batching import slow_start


def test_batches_double_and_run_concurrently() -> None:
    in_flight = 0
    peaks: list[int] = []

    async def create() -> None:
        nonlocal in_flight
        in_flight += 1
        peaks.append(in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1

    assert asyncio.run(slow_start(create, 10)) == 10
    assert len(peaks) == 10
    assert max(peaks) == 4  # batches 1, 2, 4, then the remaining 3


def test_first_failing_batch_stops_the_rest() -> None:
    calls = 0

    async def create() -> None:
        nonlocal calls
        calls += 1
        if calls >= 2:
            raise RuntimeError("exceeded quota: pods")

    with pytest.raises(RuntimeError, match="exceeded quota"):
        asyncio.run(slow_start(create, 100))
    assert calls == 3  # batch of 1 succeeded, batch of 2 both failed, nothing more was tried


def test_zero_is_nothing() -> None:
    async def create() -> None:
        raise AssertionError("must not be called")

    assert asyncio.run(slow_start(create, 0)) == 0
