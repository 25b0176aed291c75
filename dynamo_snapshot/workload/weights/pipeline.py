"""The save and load pipelines between a region (through its TransferEngine) and a weights file: chunks
downloaded, hashed, encoded and written with the steps overlapping; records read in parallel pieces into
a ring of host buffers and uploaded as each is full."""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dynamo_snapshot.fileio import ALIGN, DirectReader, pwrite_all, round_up, spans
from dynamo_snapshot.workload.weights.codec import decode_coded
from dynamo_snapshot.workload.weights.engine import HostBuffer, TransferEngine
from dynamo_snapshot.workload.weights.format import (
    ChunkRecord,
    WeightsFileError,
    coded_record_bytes,
    escape_limit,
)

__all__ = ["chunk_digests", "read_into_region", "write_file"]


def _sha256_hex(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def chunk_digests(
    engine: TransferEngine,
    bufs: Sequence[HostBuffer],
    data_bytes: int,
    chunk: int,
    threads: int,
    *,
    escapes: bool = False,
) -> tuple[list[str], list[int] | None]:
    """SHA-256 of each `chunk` of region[0:data_bytes]: downloads in order, hashes in parallel. With
    `escapes`, also each chunk's escapes as a split-nibble record (-1 where it is to be stored plain),
    counted on the engine while the host threads hash: one pass over the region, not two."""
    busy: dict[int, Future[str]] = {}
    futures: list[Future[str]] = []
    counts: list[int] | None = [] if escapes else None
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-hash") as pool:
        for i, (off, n) in enumerate(spans(data_bytes, chunk)):
            b = i % len(bufs)
            if b in busy:
                busy.pop(b).result()  # the buffer is free once its hash is done
            engine.download(off, bufs[b], n)
            fut = pool.submit(_sha256_hex, bufs[b].view()[:n])
            busy[b] = fut
            futures.append(fut)
            if counts is not None:
                k = engine.count_escapes(off, n)
                counts.append(k if k <= escape_limit(n) else -1)
        return [f.result() for f in futures], counts


def _coded_sha256(record: memoryview, nbytes: int, escapes: int) -> str:
    return hashlib.sha256(decode_coded(record, nbytes, escapes)).hexdigest()


def write_file(
    path: Path,
    engine: TransferEngine,
    bufs: Sequence[HostBuffer],
    head: bytes,
    records: Sequence[ChunkRecord],
    threads: int,
) -> None:
    """Write `head` then every chunk record to `path` (created).

    Downloads (coded records: made by the engine) in order; writer threads write each record while the
    next one downloads.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, memoryview(head), 0)
        busy: dict[int, Future[None]] = {}
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-write") as writers:
            for i, rec in enumerate(records):
                b = i % len(bufs)
                if b in busy:
                    busy.pop(b).result()
                view = bufs[b].view()
                if rec.coded:
                    length = engine.download_coded(rec.data_offset, bufs[b], rec.nbytes)
                    if length != coded_record_bytes(rec.nbytes, rec.escapes):
                        # The header (written first) would not describe this record: never write that.
                        raise WeightsFileError(f"chunk {rec.index} coded to {length} bytes, not as counted")
                    view[length : rec.stored] = bytes(rec.stored - length)
                else:
                    engine.download(rec.data_offset, bufs[b], rec.nbytes)
                busy[b] = writers.submit(pwrite_all, fd, view[: rec.stored], len(head) + rec.offset)
            for fut in busy.values():
                fut.result()
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into_region(
    reader: DirectReader,
    engine: TransferEngine,
    bufs: Sequence[HostBuffer],
    data_offset: int,
    records: Sequence[ChunkRecord],
    *,
    threads: int,
    chunk_sha256: Sequence[str] | None,
) -> None:
    """Every record of the file's data section (from `data_offset`) -> the region, through the ring
    `bufs`.

    Each record is read as several pieces by the pool; records are handed to the engine in order as
    they complete (coded ones it expands on the GPU), and a buffer is refilled only once its upload is
    done. With len(bufs) records in flight and `threads` readers the disk always has work while the
    GPU copies. With `chunk_sha256` (records are the file's chunks) every chunk is hashed as it lands
    and compared (a coded one is expanded on the CPU for that: slow).
    """
    nbuf = len(bufs)
    largest = max((r.stored for r in records), default=ALIGN)
    pieces_per_block = max(1, math.ceil(threads / max(1, nbuf - 1)))
    piece = round_up(math.ceil(largest / pieces_per_block), ALIGN)
    free = deque(range(nbuf))
    inflight: deque[tuple[ChunkRecord, int, list[Future[int]]]] = deque()
    hashing: dict[int, tuple[int, Future[str]]] = {}
    next_rec = 0

    def check_hash(b: int) -> None:
        if b in hashing:
            index, fut = hashing.pop(b)
            assert chunk_sha256 is not None
            if fut.result() != chunk_sha256[index]:
                raise WeightsFileError(f"chunk {index} of the weights file does not match its SHA-256")

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-read") as pool:
        try:
            while inflight or next_rec < len(records):
                while free and next_rec < len(records):
                    b = free.popleft()
                    engine.wait_upload(bufs[b])
                    check_hash(b)
                    rec = records[next_rec]
                    view = bufs[b].view()
                    futs = [
                        pool.submit(
                            reader.read,
                            view[p : p + min(piece, rec.stored - p)],
                            data_offset + rec.offset + p,
                        )
                        for p in range(0, rec.stored, piece)
                    ]
                    inflight.append((rec, b, futs))
                    next_rec += 1
                rec, b, futs = inflight.popleft()
                got = sum(f.result() for f in futs)
                if got != rec.stored:
                    raise WeightsFileError(
                        f"short read at data offset {rec.offset}: {got} of {rec.stored} bytes"
                    )
                view = bufs[b].view()
                if chunk_sha256 is not None:
                    hashing[b] = (
                        rec.index,
                        pool.submit(_coded_sha256, view, rec.nbytes, rec.escapes)
                        if rec.coded
                        else pool.submit(_sha256_hex, view[: rec.nbytes]),
                    )
                if rec.coded:
                    engine.upload_coded(bufs[b], rec.nbytes, rec.data_offset, rec.escapes)
                else:
                    engine.upload(bufs[b], rec.nbytes, rec.data_offset)
                free.append(b)
            for b in list(hashing):
                check_hash(b)
        except BaseException:
            for _, _, futs in inflight:
                for f in futs:
                    f.cancel()
            raise
        # Leaving the pool waits for reads still running: none writes into a buffer after this returns.
