"""The worker's side of weights that are still arriving when it resumes (FILE_WEIGHTS_ARRIVED).

A node agent that fetches an artifact from an object store can put the weights file back while its
chunks still arrive, each checked against the artifact's digest before it is written; restore-complete
then says {RESTORE_WEIGHTS_ARRIVING: true}, and the control directory's FILE_WEIGHTS_ARRIVED says how
many bytes of each file, from its start, are in and checked. A load reads no byte beyond that
(ArrivingReader), so it overlaps the transfer and never sees a byte that was not checked; the worker
still serves only after FILE_WEIGHTS_VERIFIED, when every file is whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.api.protocol import FILE_WEIGHTS_ARRIVED, FILE_WEIGHTS_VERIFIED, RESTORE_WEIGHTS_ARRIVING
from dynamo_snapshot.fileio import DirectReader
from dynamo_snapshot.workload.weights.format import PREFIX_BYTES, header_span

__all__ = [
    "ArrivingReader",
    "WeightsArrival",
    "arrived_document",
    "parse_arrived",
    "weights_arriving",
]

ARRIVED_VERSION: Final = 1
# The document lists a few files; anything this long is not one.
_MAX_ARRIVED_BYTES = 1 << 20


def weights_arriving(content: Any) -> bool:
    """Whether restore-complete's content says the weights files are still arriving."""
    return isinstance(content, Mapping) and content.get(RESTORE_WEIGHTS_ARRIVING) is True


def arrived_document(files: Mapping[str, int]) -> dict[str, Any]:
    """FILE_WEIGHTS_ARRIVED's content: bytes in and checked from the start of each file, by the path the
    worker recorded in weights.json."""
    return {"version": ARRIVED_VERSION, "files": {path: int(n) for path, n in sorted(files.items())}}


def parse_arrived(doc: Any, source: str = FILE_WEIGHTS_ARRIVED) -> dict[str, int]:
    """The files and their bytes in, from FILE_WEIGHTS_ARRIVED's JSON; ValueError naming ``source``."""
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or doc.get("version") != ARRIVED_VERSION:
        raise ValueError(f"{source}: not a version {ARRIVED_VERSION} weights arrival document")
    out: dict[str, int] = {}
    for path, n in files.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{source}: bad byte count {n!r} for {path!r}")
        out[str(path)] = n
    return out


class WeightsArrival:
    """How much of each weights file is in, as the agent says; ``wait`` blocks until a range is.

    Shared by a load's reader threads: what one read of the document learned the others use. With
    ``timeout``, TimeoutError once a wait took that long; without, the wait ends when the bytes are in or
    the agent stops this worker (a fetch that failed).
    """

    def __init__(self, control_dir: Path | str, *, timeout: float | None = None, poll: float = 0.002) -> None:
        self._dir = Path(control_dir)
        self._timeout = timeout
        self._poll = poll
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}
        self._whole = False
        self._read_at = float("-inf")  # when a reader last read the document: one read per poll for all
        self.waited = 0.0  # seconds any reader spent waiting, summed

    def _refresh(self, *, now: bool = False) -> None:
        """What the document says, read again; by the waits at most once per poll between them all."""
        with self._lock:
            at = time.monotonic()
            if not now and at - self._read_at < self._poll:
                return
            self._read_at = at
        if (self._dir / FILE_WEIGHTS_VERIFIED).exists():
            self._whole = True
            return
        path = self._dir / FILE_WEIGHTS_ARRIVED
        try:
            with open(path, "rb") as f:
                raw = f.read(_MAX_ARRIVED_BYTES + 1)
        except FileNotFoundError:
            return
        if len(raw) > _MAX_ARRIVED_BYTES:
            raise ValueError(f"{path}: over {_MAX_ARRIVED_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        files = parse_arrived(doc, str(path))
        with self._lock:
            for name, n in files.items():
                self._known[name] = max(n, self._known.get(name, 0))

    def arrived(self, path: str) -> int | None:
        """Bytes of ``path`` in and checked; None once every file is whole (FILE_WEIGHTS_VERIFIED)."""
        self._refresh(now=True)
        if self._whole:
            return None
        with self._lock:
            return self._known.get(path, 0)

    def wait(self, path: str, end: int) -> float:
        """Block until bytes 0 to ``end`` of ``path`` are in; the seconds waited."""
        started = time.monotonic()
        while True:
            with self._lock:
                got = self._known.get(path, 0)
                if self._whole or got >= end:
                    break
            waited = time.monotonic() - started
            if self._timeout is not None and waited > self._timeout:
                raise TimeoutError(
                    f"{path}: {got} of the {end} bytes needed arrived within {self._timeout:.0f}s "
                    f"({self._dir / FILE_WEIGHTS_ARRIVED})"
                )
            time.sleep(self._poll)
            self._refresh()
        waited = time.monotonic() - started
        with self._lock:
            self.waited += waited
        return waited

    def wait_header(self, path: Path) -> None:
        """Until the file's prefix and header (read_header's bytes) are in."""
        key = str(path)
        self.wait(key, PREFIX_BYTES)
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_BYTES)
        self.wait(key, header_span(prefix))


class ArrivingReader(DirectReader):
    """A DirectReader whose reads wait until the bytes they cover are in (``arrival``)."""

    def __init__(self, path: Path, direct: bool, arrival: WeightsArrival) -> None:
        super().__init__(path, direct)
        self._key = str(path)
        self._size = os.fstat(self._buffered).st_size
        self._arrival = arrival

    def read(self, view: memoryview, offset: int) -> int:
        self._arrival.wait(self._key, min(offset + len(view), self._size))
        return super().read(view, offset)
