"""A write that must land is retried until the apiserver takes it, and given up on an answer no retry
changes; a read of an object that is not there is None."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_snapshot.kube import ApiError
from dynamo_snapshot.kube.until_written import permanent, write_until_done


def _failing(*statuses: int) -> tuple[list[int], Any]:
    calls: list[int] = []

    async def write() -> None:
        calls.append(len(calls))
        if len(calls) <= len(statuses):
            raise ApiError(status=statuses[len(calls) - 1], reason="test")

    return calls, write


@pytest.mark.parametrize("status", [500, 503, 401, 408, 409, 429])
async def test_what_a_retry_can_change_is_retried_until_written(status: int) -> None:
    calls, write = _failing(status, status)
    assert await write_until_done(write, what="the test's status", extra={}, backoff=lambda _: 0.0)
    assert len(calls) == 3


@pytest.mark.parametrize("status", [400, 403, 404, 422])
async def test_an_answer_no_retry_changes_is_given_up(status: int, caplog: pytest.LogCaptureFixture) -> None:
    calls, write = _failing(status)
    assert not await write_until_done(write, what="the test's status", extra={"x": 1}, backoff=lambda _: 0.0)
    assert len(calls) == 1
    assert "giving up on the test's status" in caplog.text
    assert [r.levelname for r in caplog.records] == ["WARNING" if status == 404 else "ERROR"]


def test_permanent() -> None:
    assert [s for s in (400, 401, 403, 404, 408, 409, 422, 429, 500) if permanent(s)] == [400, 403, 404, 422]
