"""A TCP proxy in front of a real server that cuts every connection once the server has sent a given
number of bytes through it: an answer's body ends short of its Content-Length, the way a store that
dies or a network that drops mid-transfer ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def cutting_proxy(upstream_host: str, upstream_port: int, cut_after: int) -> AsyncIterator[str]:
    """Yield ``host:port`` of the proxy; each connection is closed after ``cut_after`` bytes back."""

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, budget: int | None) -> None:
        sent = 0
        while budget is None or sent < budget:
            data = await src.read(65536 if budget is None else min(65536, budget - sent))
            if not data:
                break
            dst.write(data)
            await dst.drain()
            sent += len(data)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        try:
            ahead = asyncio.create_task(pipe(reader, up_writer, None))
            await pipe(up_reader, writer, cut_after)
            ahead.cancel()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_writer):
                w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()
