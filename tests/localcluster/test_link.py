"""The shaped link of the dev harness, in front of a real server (SeaweedFS): answers through it come no
faster than its bandwidth over all connections together, and are cut where it is told to cut them."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from dynamo_snapshot_dev.localcluster.link import shaped_link
from dynamo_snapshot_dev.localcluster.s3server import LocalS3

RATE = 8 << 20  # bytes per second


@pytest.fixture(scope="module")
def server() -> Iterator[LocalS3]:
    with LocalS3() as s3:
        yield s3


async def test_answers_share_the_links_bandwidth(server: LocalS3) -> None:
    await server.create_bucket("link")
    async with server.client() as client:
        await client.put_object(Bucket="link", Key="blob", Body=os.urandom(4 << 20))
    upstream = urlsplit(server.endpoint)
    assert upstream.hostname is not None
    assert upstream.port is not None
    async with (
        shaped_link(upstream.hostname, upstream.port, bytes_per_s=RATE) as hostport,
        server.client(f"http://{hostport}") as client,
    ):

        async def get() -> int:
            answer = await client.get_object(Bucket="link", Key="blob")
            async with answer["Body"] as body:
                return len(await body.read())

        started = time.monotonic()
        got = await asyncio.gather(get(), get())
        elapsed = time.monotonic() - started
    assert got == [4 << 20, 4 << 20]
    # 8 MiB over a link of 8 MiB/s: not under a second, whatever the machine.
    assert elapsed >= 0.95 * sum(got) / RATE
