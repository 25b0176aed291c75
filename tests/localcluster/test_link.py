"""The shaped link of the dev harness, in front of a real server (SeaweedFS): answers through it come no
faster than its bandwidth over all connections together, and are cut where it is told to cut them."""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import urlsplit

from dynamo_snapshot_dev.localcluster.link import shaped_link
from dynamo_snapshot_dev.localcluster.s3server import LocalS3

RATE = 8 << 20  # bytes per second


async def test_answers_share_the_links_bandwidth(s3_server: LocalS3) -> None:
    await s3_server.create_bucket("link")
    async with s3_server.client() as client:
        await client.put_object(Bucket="link", Key="blob", Body=os.urandom(4 << 20))
    upstream = urlsplit(s3_server.endpoint)
    assert upstream.hostname is not None
    assert upstream.port is not None
    async with (
        shaped_link(upstream.hostname, upstream.port, bytes_per_s=RATE) as hostport,
        s3_server.client(f"http://{hostport}") as client,
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
