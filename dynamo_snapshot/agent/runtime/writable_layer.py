"""A container's writable layer carried by a checkpoint: captured from the source container with what its
tree holds told apart, and written into one restore container, the part CRIU opens before it and the rest
in a thread beside CRIU and the CUDA restore (rootfs_diff's two parts)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError
from dynamo_snapshot.agent.runtime.held_files import held_paths
from dynamo_snapshot.agent.runtime.rootfs_diff import DiffApply, RootfsDiffError, capture_diff

__all__ = ["LayerWriting", "capture_layer"]


async def capture_layer(
    upper: Path, out: Path, tree: Callable[[], Iterable[int]], exclude: Sequence[str]
) -> dict[str, Any]:
    """The layer at ``upper`` written to ``out``, what the processes ``tree`` lists hold first (the tree is
    at its checkpoint: what it holds now is what CRIU opens at restore); what the container's description
    records of it. RootfsDiffError or OSError where it cannot be captured."""
    held = await asyncio.to_thread(lambda: held_paths(tree()))
    diff = await asyncio.to_thread(capture_diff, upper, out, exclude=exclude, held=held)
    return {"files": diff.files, "bytes": diff.bytes, "deleted": diff.deleted, "early": diff.early}


def _refused(e: Exception) -> WorkloadRuntimeError:
    return WorkloadRuntimeError(f"writable layer not applied: {e}")


def _close_unclaimed(began: asyncio.Future[DiffApply]) -> None:
    if not began.cancelled() and began.exception() is None:
        began.result().close()


class LayerWriting:
    """One restore's writing of a layer: ``begin`` returns once CRIU may start, ``finish`` once every file
    is written, ``abandon`` stops what is left of it."""

    def __init__(self) -> None:
        self._rest: asyncio.Task[float] | None = None
        self._applying: DiffApply | None = None

    async def begin(self, diff: Path, rootfs: Path, exclude: Sequence[str]) -> None:
        began = asyncio.ensure_future(asyncio.to_thread(DiffApply.begin, diff, rootfs, exclude=exclude))
        try:
            applying = await asyncio.shield(began)
        except asyncio.CancelledError:
            # The thread goes on to its end; what it opened is closed once it gets there.
            began.add_done_callback(_close_unclaimed)
            raise
        except (RootfsDiffError, OSError) as e:
            raise _refused(e) from None
        if applying.complete:
            try:
                await asyncio.to_thread(applying.rest)  # closes what it applied, whatever comes of it
            except (RootfsDiffError, OSError) as e:
                raise _refused(e) from None
            return

        def rest() -> float:
            started = time.monotonic()
            applying.rest()
            return time.monotonic() - started

        self._applying = applying
        self._rest = asyncio.create_task(asyncio.to_thread(rest))

    async def finish(self) -> float | None:
        """Seconds the files written beside CRIU took, once all are; None where all went before CRIU."""
        task, self._rest, self._applying = self._rest, None, None
        if task is None:
            return None
        try:
            return await task
        except (RootfsDiffError, OSError) as e:
            raise _refused(e) from None

    async def abandon(self) -> None:
        """The restore ended sooner: the writing stops before its next file and is waited for."""
        task, applying = self._rest, self._applying
        self._rest = self._applying = None
        if task is not None and applying is not None:
            applying.stop.set()
            with contextlib.suppress(RootfsDiffError, OSError):
                await task
