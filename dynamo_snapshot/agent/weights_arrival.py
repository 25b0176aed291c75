"""Weights put back while they still arrive from the object store (agent ``--s3-stream-weights``).

For a worker whose SDK waits for each byte of a weights file (its weights manifest says
``reads_arriving_weights``) the restore does not wait for the fetch to bring the weights: once a file's
header is in and names the checkpoint's weights, the file the fetch is filling is linked to where the
worker loads it, the worker is told to go on, and the control directory's FILE_WEIGHTS_ARRIVED says, as
chunks come in and are checked, how much of each file from its start the worker may read. So the
worker's load overlaps the transfer. Once the fetch published the whole artifact, weights-verified is
written: every byte the worker read was checked on arrival. The fetch no longer vouches for these files
in the node's verified-files record (the worker could write into them), so a later restore checks them
again; a fetch that fails fails the restore, which stops the worker before it ever serves.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from dynamo_snapshot.agent.artifact_fetch import NodeFetch
from dynamo_snapshot.agent.sentinels import write_sentinel
from dynamo_snapshot.agent.weights import CarriedWeights, check_carried
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import Artifact
from dynamo_snapshot.workload.weights import PREFIX_BYTES, arrived_document
from dynamo_snapshot.workload.weights.format import header_span

__all__ = ["ArrivingWeights"]


class ArrivingWeights:
    """The weights files of one restore's artifact that ``fetch`` is still bringing (``files``)."""

    def __init__(self, fetch: NodeFetch, files: list[str]) -> None:
        self.fetch = fetch
        self.files = files
        self._feed: asyncio.Task[None] | None = None

    async def headers_in(self, artifact: Artifact, weights: list[CarriedWeights]) -> None:
        """Until each file's header is in; then checked to name the checkpoint's weights
        (WeightsPlacementError otherwise)."""
        for w in weights:
            path = artifact.path / w.file
            await self.fetch.range_in(w.file, 0, PREFIX_BYTES)
            prefix = await asyncio.to_thread(_read_prefix, path)
            await self.fetch.range_in(w.file, 0, header_span(prefix))
            await asyncio.to_thread(check_carried, path, w)

    def expose(self) -> bool:
        """Whether the files may go to the worker before they are whole (not once the fetch ended)."""
        return all(self.fetch.expose(f) for f in self.files)

    def feed(self, control_dir: Path, weights: list[CarriedWeights]) -> None:
        """FILE_WEIGHTS_ARRIVED in ``control_dir`` kept up to date until every file is in."""
        self._feed = asyncio.create_task(self._run(control_dir, weights), name="weights-arrival")

    async def _run(self, control_dir: Path, weights: list[CarriedWeights]) -> None:
        arrived = {w.worker_path: 0 for w in weights}
        writing = asyncio.Lock()
        path = control_dir / protocol.FILE_WEIGHTS_ARRIVED

        async def follow(w: CarriedWeights) -> None:
            size = self.fetch.size(w.file)
            step = self.fetch.chunk_bytes(w.file)
            for offset in range(0, size, step):
                length = min(step, size - offset)
                await self.fetch.range_in(w.file, offset, length)
                async with writing:
                    arrived[w.worker_path] = offset + length
                    await asyncio.to_thread(write_sentinel, path, arrived_document(arrived))

        # One file's failure (its fetch's) ends the others' follow-ups too.
        async with asyncio.TaskGroup() as group:
            for w in weights:
                group.create_task(follow(w))

    async def fed(self) -> None:
        """Until the last FILE_WEIGHTS_ARRIVED is written; raises what ended the fetch without them."""
        if self._feed is None:
            return
        try:
            await self._feed
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None

    async def stop(self) -> None:
        """The restore failed: no more updates (what the feed failed with is the restore's own error)."""
        if self._feed is not None:
            self._feed.cancel()
            with contextlib.suppress(BaseException):
                await self._feed


def _read_prefix(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(PREFIX_BYTES)
