"""Small async helpers shared by the controller-runtime tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(cond: Callable[[], bool], within: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``within`` seconds."""
    await eventually_async(lambda: _const(cond()), within, what)


async def _const(value: bool) -> bool:
    return value


async def eventually_async(
    cond: Callable[[], Awaitable[bool]], within: float = 10.0, what: str = "condition"
) -> None:
    try:
        async with asyncio.timeout(within):
            # Polling is the point here: the conditions are state owned by the code under test.
            while not await cond():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {what}") from None
