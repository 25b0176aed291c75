"""A restore whose memory pages are still arriving from the object store (agent ``--s3-stream-pages``).

The fetch brings the process images but the pages first; the restore checks those, then CRIU restores
the tree with ``--lazy-pages`` (criu.streamed_pages): it waits only for the pages it cannot take lazily,
and every other page reaches the restored processes through the page server once the fetch has it in and
checked, on a process's first touch or in the background. So the tree is back, and its CUDA restore and
handshake run, while most of its memory is on the way; no byte reaches it unchecked. Should the fetch fail
after the restore (a chunk that does not match, the store gone), the pages a process still lacks cannot
come: the tree is stopped and the failure logged and counted, as a restore that failed.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from dynamo_snapshot.agent.artifact_fetch import NodeFetch
from dynamo_snapshot.agent.metrics import FAILURES, PAGES_STREAMED
from dynamo_snapshot.agent.runtime.base import Runtime, Workload
from dynamo_snapshot.criu import Criu, CriuError
from dynamo_snapshot.criu.streamed_pages import StreamedPagesCriu

__all__ = ["PagesStream"]

log = logging.getLogger(__name__)


class PagesStream:
    """The pages images of one restore's artifact that ``fetch`` is still bringing (``files``)."""

    def __init__(self, fetch: NodeFetch, files: list[str]) -> None:
        self.fetch = fetch
        self.files = files
        self.criu: StreamedPagesCriu | None = None

    async def ready(self, name: str, offset: int, length: int) -> None:
        await self.fetch.range_in(f"criu/{name}", offset, length)

    async def restore(
        self, runtime: Runtime, key: str, images: Path, source_control_dir: str | None, base: Criu
    ) -> Workload:
        self.criu = StreamedPagesCriu(base, self.ready)
        return await runtime.restore(key, images, source_control_dir, criu=self.criu)

    async def abandon(self) -> None:
        """The restore failed after CRIU: its lazy-pages daemon and page server go too."""
        if self.criu is not None:
            await self.criu.abandon()

    def watch(self, runtime: Runtime, key: str, tasks: set[asyncio.Task[None]]) -> None:
        """Until every page moved into the restored tree (held in ``tasks``); a failure stops the tree."""
        criu = self.criu
        if criu is None:
            return

        async def run() -> None:
            try:
                stats = await criu.finished()
            except CriuError as e:
                FAILURES.labels("restore").inc()
                log.error("restored tree lost its memory pages: stopped", extra={"key": key, "error": str(e)})
                await runtime.stop(key)
                return
            PAGES_STREAMED.inc(stats.bytes)
            moved = {"bytes": stats.bytes, "asks": stats.asks, "waited_s": round(stats.waited_s, 3)}
            log.info("memory pages streamed", extra={"key": key, **moved})

        task = asyncio.create_task(run(), name=f"pages-{key}")
        tasks.add(task)
        task.add_done_callback(tasks.discard)
