"""WeightRegion: model weights in one VmmRegion that the worker packs, saves to a weights file once,
releases before the checkpoint and loads back, at the same addresses, after the restore."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.fileio import (
    ALIGN,
    DirectReader,
    page_cache_fraction,
    spans,
    write_replacing,
)
from dynamo_snapshot.workload.gpu_memory import KIND_WEIGHTS, RegionPool, VmmRegion, _import_torch, round_up
from dynamo_snapshot.workload.weights.arrival import ArrivingReader, WeightsArrival
from dynamo_snapshot.workload.weights.engine import EngineFactory, HostBuffer, TorchEngine, TransferEngine
from dynamo_snapshot.workload.weights.format import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TENSOR_ALIGNMENT,
    ENCODING_RAW,
    ENCODING_SPLIT_NIBBLE,
    ENCODINGS,
    ChunkRecord,
    Encoding,
    TensorSpec,
    WeightsFileError,
    WeightsHeader,
    data_digest,
    plan_layout,
    read_header,
)
from dynamo_snapshot.workload.weights.manifest import WeightsFile
from dynamo_snapshot.workload.weights.pipeline import (
    chunk_digests,
    read_into_region,
    write_file,
)

__all__ = ["DEFAULT_BLOCK_BYTES", "LoadResult", "SaveResult", "WeightRegion", "pack_module"]

DEFAULT_BLOCK_BYTES: Final = 64 << 20
# load(direct=None) reads through the page cache when at least this much of the file is in it (the
# agent warmed it): O_DIRECT would ignore those pages and go to the disk again.
_RESIDENT_FOR_BUFFERED: Final = 0.5


@dataclass(frozen=True)
class SaveResult:
    path: str
    bytes: int  # file size
    data_bytes: int
    data_digest: str
    written: bool  # False: an identical file was there already
    seconds: float  # in total
    digest_seconds: float  # reading the region and hashing its chunks
    write_seconds: float

    def manifest_entry(self, device: int) -> WeightsFile:
        return WeightsFile(self.path, self.bytes, self.data_digest, device)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadResult:
    path: str
    bytes: int  # data bytes moved to the GPU
    seconds: float  # reading and copying (the pipeline), after reacquire
    direct: bool  # every read went through O_DIRECT
    verified: bool  # every chunk's SHA-256 was checked
    reacquire_seconds: float
    resident_fraction: float | None  # of the file in the page cache before the load (None: unknown)
    threads: int
    block: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gbps"] = round(self.gbps, 3)
        return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsFileError(f"unknown dtype {name!r}")
    return dtype


class WeightRegion:
    """Model weights in one VmmRegion: pack, save, release, load.

    `engine` makes the TransferEngine for a region (default: torch, pinned buffers, one CUDA stream);
    tests pass a stand-in. `driver` replaces cuda.bindings.driver.
    """

    def __init__(
        self,
        *,
        device: int = 0,
        alignment: int = DEFAULT_TENSOR_ALIGNMENT,
        kind: str = KIND_WEIGHTS,
        pool: RegionPool | None = None,
        driver: Any | None = None,
        engine: EngineFactory | None = None,
    ) -> None:
        self.device = device
        self.alignment = alignment
        self._kind = kind
        self._pool = pool
        self._driver = driver
        self._engine: EngineFactory = engine if engine is not None else TorchEngine
        self.region: VmmRegion | None = None
        self._specs: list[TensorSpec] | None = None
        self._end = 0
        self._views: dict[str, Any] | None = None

    # ---- layout ----

    @property
    def specs(self) -> list[TensorSpec]:
        return list(self._specs or [])

    @property
    def data_bytes(self) -> int:
        """Bytes a save writes: the layout's end rounded up to ALIGN."""
        return round_up(self._end, ALIGN)

    @property
    def released(self) -> bool:
        return self.region is not None and not self.region.mapped

    def allocate(self, tensors: Iterable[tuple[str, str, Sequence[int], int]]) -> list[TensorSpec]:
        """Lay out (name, dtype, shape, nbytes) entries and create the region for them."""
        if self.region is not None:
            raise RuntimeError("this WeightRegion is allocated already")
        specs, end = plan_layout(tensors, self.alignment)
        size = max(round_up(end, ALIGN), ALIGN)
        self.region = VmmRegion(size, self.device, kind=self._kind, pool=self._pool, driver=self._driver)
        self._specs, self._end = specs, end
        return list(specs)

    @property
    def views(self) -> dict[str, Any]:
        """A tensor view per spec, by name (made on first use; needs torch)."""
        if self.region is None or self._specs is None:
            raise RuntimeError("this WeightRegion holds no tensors yet: pack() or load() first")
        if self._views is None:
            torch = _import_torch()
            region = self.region
            self._views = {
                s.name: region.as_tensor(_torch_dtype(torch, s.dtype), s.shape, s.offset) for s in self._specs
            }
        return dict(self._views)

    def pack(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Copy the tensors (any device, any layout) into a new region, in order, each aligned; the
        views of the copies by name, to re-point the model at (`param.data = view`)."""
        torch = _import_torch()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self.allocate(
            (name, _dtype_name(t.dtype), tuple(t.shape), int(t.numel()) * int(t.element_size()))
            for name, t in items
        )
        views = self.views
        with torch.no_grad():
            for name, t in items:
                views[name].copy_(t)
        torch.cuda.synchronize(torch.device("cuda", self.device))
        return views

    def _header(self, digests: list[str], chunk: int, encoding: Encoding | None = None) -> WeightsHeader:
        assert self.region is not None
        assert self._specs is not None
        return WeightsHeader(
            tensors=tuple(self._specs),
            data_bytes=self.data_bytes,
            device_bytes=self.region.size,
            chunk_bytes=chunk,
            chunk_sha256=tuple(digests),
            data_digest=data_digest(digests),
            alignment=self.alignment,
            encoding=encoding,
        )

    # ---- save ----

    def save(
        self,
        path: Path | str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        threads: int = 8,
        encoding: str = ENCODING_SPLIT_NIBBLE,
    ) -> SaveResult:
        """Write the region to `path`, unless a file with the same
        header (so the same content, stored the same way) is there already. Needs the region mapped.

        `encoding`: ENCODING_SPLIT_NIBBLE (default; ~1.33x smaller for bf16/fp16 weights, so a load
        reads that much less) or ENCODING_RAW (version 1, as on the GPU)."""
        region = self.region
        if region is None or self._specs is None:
            raise RuntimeError("nothing to save: pack() first")
        if not region.mapped:
            raise RuntimeError("the weights are released: load() them before saving")
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        path = Path(path).absolute()
        started = time.monotonic()
        engine = self._engine(region)
        try:
            nbuf = max(1, min(threads + 1, -(-self.data_bytes // chunk_bytes)))
            bufs = [engine.host_buffer(min(chunk_bytes, max(self.data_bytes, ALIGN))) for _ in range(nbuf)]
            digests, escapes = chunk_digests(
                engine, bufs, self.data_bytes, chunk_bytes, threads, escapes=encoding == ENCODING_SPLIT_NIBBLE
            )
            enc = None if escapes is None else Encoding(ENCODING_SPLIT_NIBBLE, tuple(escapes))
            header = self._header(digests, chunk_bytes, enc)
            head = header.encode()
            hashed = time.monotonic()
            written = not _same_file(path, header, len(head))
            if written:
                _write_replacing(path, engine, bufs, head, header, threads)
        finally:
            engine.close()
        done = time.monotonic()
        return SaveResult(
            path=str(path),
            bytes=len(head) + header.stored_bytes,
            data_bytes=self.data_bytes,
            data_digest=header.data_digest,
            written=written,
            seconds=done - started,
            digest_seconds=hashed - started,
            write_seconds=done - hashed,
        )

    # ---- release / load ----

    def release(self) -> int:
        """Give the GPU memory back (the views stay, pointing at nothing until load()); bytes released."""
        if self.region is None:
            return 0
        return self.region.release()

    def load(
        self,
        path: Path | str,
        *,
        threads: int = 16,
        block: int = DEFAULT_BLOCK_BYTES,
        buffers: int = 4,
        verify: bool = False,
        direct: bool | None = None,
        arriving: WeightsArrival | None = None,
    ) -> LoadResult:
        """Map the region again (at the same addresses) and fill it from `path`.

        `threads` parallel reads of pieces of `block`-byte blocks, through a ring of `buffers` pinned
        buffers of `block` bytes, each copied to the GPU asynchronously as soon as it is full. `direct`:
        O_DIRECT (True), the page cache (False), or None: O_DIRECT unless the file is mostly in the
        page cache already. A split-nibble file (version 2) is read record by record, one record per
        chunk of the header's chunk_bytes (64 MiB by default; `block` is then ignored): each record is
        read whole into one pinned buffer (in pieces, by the same threads) and expanded on the GPU by
        the engine's upload_coded; a chunk stored plain is uploaded as it is.

        `verify` checks every chunk's SHA-256 as it lands (records are then the file's chunks, raw
        files too). For a coded record the hash is of decode_coded's output, the plain-Python
        reference decode of the record on the CPU, not of what the GPU expanded: it proves the file
        intact, not the GPU's expansion, and it is slow (0.125 GB/s, BENCHMARKS.md). The file's
        header, size and layout are always checked. A region that has no layout yet (a new
        WeightRegion) takes the file's.

        `arriving`: the file is still arriving (weights.arrival); every read, the header's first,
        waits until the agent says its bytes are in, and goes through the page cache.
        """
        if threads <= 0 or buffers <= 0:
            raise ValueError("threads and buffers must be positive")
        if block <= 0 or block % ALIGN:
            raise ValueError(f"block must be a positive multiple of {ALIGN}")
        path = Path(path).absolute()
        if arriving is not None:
            arriving.wait_header(path)
            direct = False
        header, data_offset = read_header(path)
        self._take_layout(path, header)
        assert self.region is not None
        block, records = _load_records(header, block, verify)
        t0 = time.monotonic()
        self.region.reacquire()
        reacquired = time.monotonic()
        resident = page_cache_fraction(path)
        use_direct = direct if direct is not None else (resident is None or resident < _RESIDENT_FOR_BUFFERED)
        size = min(block, header.data_bytes) if header.data_bytes else ALIGN
        direct_reads = self._fill(
            path, header, data_offset, records, (size, buffers, threads), verify, use_direct, arriving
        )
        done = time.monotonic()
        return LoadResult(
            path=str(path),
            bytes=header.data_bytes,
            seconds=done - reacquired,
            direct=direct_reads,
            verified=verify,
            reacquire_seconds=reacquired - t0,
            resident_fraction=resident,
            threads=threads,
            block=block,
            extra={
                "stored_bytes": header.stored_bytes,
                "encoding": header.encoding.name if header.encoding else ENCODING_RAW,
            },
        )

    def _fill(
        self,
        path: Path,
        header: WeightsHeader,
        data_offset: int,
        records: Sequence[ChunkRecord],
        ring: tuple[int, int, int],
        verify: bool,
        use_direct: bool,
        arriving: WeightsArrival | None,
    ) -> bool:
        """The region filled from the file's ``records`` through a ring of (buffer size, buffers, reader
        threads); whether every read went through O_DIRECT."""
        assert self.region is not None
        size, buffers, threads = ring
        engine = self._engine(self.region)
        try:
            bufs = [engine.host_buffer(size) for _ in range(buffers)]
            aligned = use_direct and all(b.aligned for b in bufs)
            reader = (
                DirectReader(path, aligned) if arriving is None else ArrivingReader(path, aligned, arriving)
            )
            try:
                read_into_region(
                    reader,
                    engine,
                    bufs,
                    data_offset,
                    records,
                    threads=threads,
                    chunk_sha256=header.chunk_sha256 if verify else None,
                )
                engine.finish()
            finally:
                reader.close()
        finally:
            engine.close()
        return reader.direct

    def _take_layout(self, path: Path, header: WeightsHeader) -> None:
        """Allocate a new region with the file's layout, or check that this region's is the file's."""
        if self.region is None:
            self.alignment = header.alignment
            self.allocate((t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors)
        assert self._specs is not None
        if tuple(self._specs) != header.tensors or header.data_bytes != self.data_bytes:
            raise WeightsFileError(f"{path}: its tensor layout is not this region's")

    @classmethod
    def from_file(cls, path: Path | str, *, device: int = 0, **load_args: Any) -> WeightRegion:
        """A new region laid out and filled from a weights file (a cold start that skips the model
        loader); its tensors are in .views."""
        region = cls(device=device)
        region.load(path, **load_args)
        return region

    def free(self) -> None:
        """Give everything back, address range included; drop the views first."""
        self._views = None
        if self.region is not None:
            self.region.free()


def _write_replacing(
    path: Path,
    engine: TransferEngine,
    bufs: Sequence[HostBuffer],
    head: bytes,
    header: WeightsHeader,
    threads: int,
) -> None:
    """Write the file beside `path` and rename it over `path` once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_replacing(path, lambda tmp: write_file(tmp, engine, bufs, head, header.records(), threads))


def _load_records(header: WeightsHeader, block: int, verify: bool) -> tuple[int, list[ChunkRecord]]:
    """(block, records) a load reads: the file's chunks when it verifies them or the file is encoded
    (a record is then a chunk), else `block`-byte pieces of the raw data."""
    if verify or header.encoding is not None:
        return header.chunk_bytes, header.records()
    return block, [ChunkRecord(i, off, n, off) for i, (off, n) in enumerate(spans(header.data_bytes, block))]


def _same_file(path: Path, header: WeightsHeader, head_len: int) -> bool:
    """An existing file at `path` holds exactly this header (so this content) at the right size."""
    try:
        existing, data_offset = read_header(path)
    except (OSError, WeightsFileError):
        return False
    return existing == header and data_offset == head_len


def pack_module(module: Any, *, device: int = 0, **region_args: Any) -> WeightRegion:
    """Pack a torch module's parameters and buffers into a new WeightRegion and re-point each at its
    copy (`tensor.data = view`), so the module runs on the region's memory from then on."""
    torch = _import_torch()
    named = list(module.named_parameters()) + list(module.named_buffers())
    region = WeightRegion(device=device, **region_args)
    views = region.pack(named)
    with torch.no_grad():
        for name, tensor in named:
            tensor.data = views[name]
    return region
