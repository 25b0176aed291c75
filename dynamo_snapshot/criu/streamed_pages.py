"""A CRIU restore that starts before the memory pages are all in: ``--lazy-pages``, with the pages served
by ``criu.page_server`` as they arrive.

The restore reads the images themselves (the pagemaps, the process and file images) and the pages it
cannot take lazily (stacks, shared and file mappings: ``PageIndex.eager``), which it waits for first;
every other page of private memory comes through a ``criu lazy-pages`` daemon, on the restored process's
first touch or in the background, from a page server that hands out each range only once ``ready`` says
it is in and checked. ``finished`` ends once every page moved (or says why not).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Any

from dynamo_snapshot.criu.errors import CriuError
from dynamo_snapshot.criu.page_server import PageIndex, PageServerStats, Ready, serve_pages
from dynamo_snapshot.criu.runner import Criu, RestoreResult

__all__ = ["StreamedPagesCriu"]

# How long the daemon may take to move the last page once the pages are all in.
_DRAIN_S = 120.0


class StreamedPagesCriu(Criu):
    """``base``'s CRIU (binary and restore settings) for one restore whose pages ``ready`` lets through."""

    def __init__(self, base: Criu, ready: Ready) -> None:
        super().__init__(
            base.binary,
            kept_logs=base.kept_logs,
            restore_huge_pages=base.restore_huge_pages,
            restore_readers=base.restore_readers,
        )
        self._ready = ready
        self._daemon: asyncio.subprocess.Process | None = None
        self._server: asyncio.Task[PageServerStats] | None = None
        self._log = Path()

    async def restore(self, images_dir: Path, **kwargs: Any) -> RestoreResult:
        work = Path(kwargs.get("log_dir") or images_dir)
        index = await asyncio.to_thread(PageIndex, images_dir)
        for name, offset, length in index.eager():
            await self._ready(name, offset, length)
        ours, theirs = socket.socketpair()
        try:
            self._daemon = await self.lazy_pages_daemon(images_dir, work, theirs.fileno())
        finally:
            theirs.close()
        self._log = work / "lazy-pages.log"
        self._server = asyncio.create_task(
            serve_pages(ours, images_dir, index, self._ready, await self.version())
        )
        extra = (*kwargs.pop("extra_args", ()), "--lazy-pages")
        try:
            return await super().restore(images_dir, **kwargs, extra_args=extra)
        except BaseException:
            await self.abandon()
            raise

    async def finished(self) -> PageServerStats:
        """Once every page moved into the restored tree: what the server gave. CriuError where the daemon
        or the server failed (the pages a process still lacked it cannot get: it dies on its next touch
        of them)."""
        assert self._daemon is not None
        assert self._server is not None
        daemon, server = self._daemon, self._server
        try:
            stats = await server
        except Exception as e:
            await self.abandon()
            raise CriuError("lazy-pages", None, f"the page server stopped: {e}") from e
        try:
            code = await asyncio.wait_for(daemon.wait(), _DRAIN_S)
        except TimeoutError:
            await self.abandon()
            raise CriuError("lazy-pages", None, f"the daemon did not end within {_DRAIN_S:.0f} s") from None
        if code != 0:
            raise CriuError("lazy-pages", code, f"the daemon failed: see {self._log}")
        return stats

    async def abandon(self) -> None:
        """Stop the daemon and the server (a failed restore, or one given up)."""
        if self._server is not None:
            self._server.cancel()
            with contextlib.suppress(BaseException):
                await self._server
        if self._daemon is not None and self._daemon.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._daemon.kill()
            await self._daemon.wait()
