"""A TCP proxy in front of a local server that makes the link to it what a remote one would be: its answers
limited to a bandwidth shared by every connection (a remote store's), or each connection cut once the server
has sent a given number of bytes through it (a store that dies, or a network that drops, mid-answer: the
body ends short of its Content-Length). Runs on the caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["shaped_link"]

_PIECE = 64 << 10


class _Bandwidth:
    """One budget of bytes per second for every connection: each piece waits its turn on the link."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = time.monotonic()
        self._lock = asyncio.Lock()

    async def send(self, n: int) -> None:
        async with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / self.bytes_per_s
            wait = self._free_at - now
        await asyncio.sleep(wait)


async def _pipe(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, budget: int | None, link: _Bandwidth | None
) -> None:
    sent = 0
    while budget is None or sent < budget:
        data = await src.read(_PIECE if budget is None else min(_PIECE, budget - sent))
        if not data:
            break
        if link is not None:
            await link.send(len(data))
        dst.write(data)
        await dst.drain()
        sent += len(data)


@contextlib.asynccontextmanager
async def shaped_link(
    upstream_host: str,
    upstream_port: int,
    *,
    bytes_per_s: float | None = None,
    cut_after: int | None = None,
) -> AsyncIterator[str]:
    """Yield ``host:port`` of the proxy: answers at most ``bytes_per_s`` over all connections, each
    connection closed after ``cut_after`` bytes of answer."""
    link = _Bandwidth(bytes_per_s) if bytes_per_s else None
    # The connections being served: the server's close leaves them running (Python 3.11), so they are
    # ended with the link rather than left pending when the event loop closes.
    serving: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            serving.add(me)
            me.add_done_callback(serving.discard)
        up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        ahead = asyncio.create_task(_pipe(reader, up_writer, None, None))
        try:
            await _pipe(up_reader, writer, cut_after, link)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            ahead.cancel()
            with contextlib.suppress(BaseException):
                await ahead
            for w in (writer, up_writer):
                w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        for task in list(serving):
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await server.wait_closed()
