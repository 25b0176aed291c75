"""The dev harness's S3 server (SeaweedFS) holds a test session's buckets: each bucket takes a volume of
its own, and the server's cap on volumes does not depend on the machine's free disk."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from typing import Any

from dynamo_snapshot_dev.localcluster.s3server import MAX_VOLUMES, LocalS3


def _topology(server: LocalS3) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.master_port}/dir/status", timeout=10) as answer:
        topology = json.load(answer)["Topology"]
    assert isinstance(topology, dict)
    return topology


async def test_every_bucket_takes_a_volume_and_the_cap_is_not_the_disks(s3_server: LocalS3) -> None:
    before = await asyncio.to_thread(_topology, s3_server)
    # mini's own cap is free GiB / volume GiB: 64 on a 67 GiB disk, fewer than a session's buckets.
    assert before["Max"] == MAX_VOLUMES
    for _ in range(3):
        bucket = await s3_server.new_bucket("volumes")
        async with s3_server.client() as client:
            await client.put_object(Bucket=bucket, Key="blob", Body=os.urandom(1 << 16))
    after = await asyncio.to_thread(_topology, s3_server)
    assert before["Free"] - after["Free"] >= 3
