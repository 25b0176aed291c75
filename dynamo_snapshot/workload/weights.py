"""Model weights kept out of the checkpoint: packed into one VmmRegion, saved once to a file laid out
for fast reads, released before the checkpoint and read back after the restore.

The CUDA checkpoint copies all device memory through host memory and CRIU writes it into the image; a
restore reads it back the same way. Weights do not need that trip: they are immutable and already
exist as a file. So the worker packs its weights into a WeightRegion (pack() copies the tensors in and
returns views; the model's parameters are re-pointed at them with `param.data = view`), saves the
region once (save()), releases it (release()), and after the restore load() maps new memory at the
same addresses and fills it from the file: parallel reads (O_DIRECT when the file is not in the page
cache) into a small ring of pinned host buffers, each handed to an asynchronous host-to-device copy as
soon as it is full, so reading and copying overlap.

File format (version 1: raw data; version 2: encoded data), all integers little-endian:

    [0, 128)                 prefix: magic b"DSWEIGHT", u32 version, u32 flags (0), u64 header length,
                             u64 data offset, u64 stored data bytes, 32-byte SHA-256 of the header;
                             zero padded
    [128, 128 + header)      header: UTF-8 JSON (keys sorted): format, version, alignment, tensors
                             [{name, dtype, shape, offset, nbytes}] in layout order, data_bytes,
                             device_bytes, chunk_bytes, chunk_sha256 [SHA-256 of each chunk_bytes piece
                             of the data], data_digest (SHA-256 of the concatenated chunk digests);
                             version 2 adds encoding {name, escapes}
    [.., data offset)        zeros up to a multiple of 4096
    [data offset, +stored)   version 1: the region's first data_bytes bytes (a multiple of 4096), as on
                             the GPU; version 2: one record per chunk, see "encoding" below

Encoding "split-nibble" (version 2) stores a chunk of n bytes (h = n/2 odd and h even bytes) as

    [0, h)                   the even bytes (low byte of each little-endian 16-bit word), as they are
    [h, h + h/2)             the odd bytes as 4-bit codes: byte i holds the code of odd byte i in its
                             low nibble and that of odd byte i + h/2 in its high nibble
    [.., +16)                the table: code c < 15 stands for the odd byte table[c]; 15 is an escape
    [.., +4k)                the escapes' positions in the odd plane, ascending (u32)
    [.., +k)                 the escapes' odd bytes
    zeros up to a multiple of 4096

with k = escapes[i] in the header; the table is the chunk's 15 most frequent odd bytes (most frequent
first; a tie: the smaller byte first). A chunk where more than h/16 odd bytes would be escapes is stored
as its n bytes (escapes[i] = -1). For bf16/fp16 weights the odd byte of each word is the sign and the
top of the exponent, and 15 values cover nearly all of a chunk: it shrinks to ~3/4 (1.33x). The
format is built for the GPU: a load reads each record into pinned memory as it is and the GPU expands
it (TransferEngine.upload_coded), so loading weights costs the CPU nothing but the reads. (Deflating
the odd bytes instead saves more, 1.49x, but inflating 8.8 GB of weights kept the H200 host's 16 cores
busy for 4 s after the process was restored, longer than reading the bytes it saved.) chunk_sha256 and
data_digest are of the data as on the GPU, whatever the encoding, so a file's identity does not depend
on how it is stored.

Offsets and sizes are multiples of 4096 so O_DIRECT can read the data in place. The per-chunk digests
let a load verify what it reads in parallel (verify=True). Next to the file, FILE.sha256 holds the
SHA-256 of the whole file in `sha256sum` format; the control directory's weights.json
(FILE_WEIGHTS_MANIFEST) lists each weights file with its size and that SHA-256, so the node agent can
verify the file and warm the page cache with it (warm_page_cache) while CRIU restores the process.

torch is needed only to move bytes (pack, save, load use it through TransferEngine); everything else,
the format included, is plain Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import math
import mmap
import os
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from dynamo_snapshot.api.protocol import (
    FILE_WEIGHTS_MANIFEST,
    FILE_WEIGHTS_VERIFIED,
    RESTORE_WEIGHTS_CHECK,
    WEIGHTS_CHECK_PENDING,
)
from dynamo_snapshot.workload.gpu_memory import (
    KIND_WEIGHTS,
    RegionPool,
    VmmRegion,
    _import_torch,
    register_host_memory,
    round_up,
    unregister_host_memory,
)

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TENSOR_ALIGNMENT",
    "ENCODINGS",
    "ENCODING_RAW",
    "ENCODING_SPLIT_NIBBLE",
    "FILE_WEIGHTS_MANIFEST",
    "FORMAT_VERSION",
    "MAGIC",
    "NIBBLE_ESCAPE",
    "NIBBLE_TABLE",
    "PREFIX_BYTES",
    "Encoding",
    "HostBuffer",
    "LoadResult",
    "MmapBuffer",
    "OffloadManifest",
    "SaveResult",
    "TensorSpec",
    "TransferEngine",
    "WarmResult",
    "WeightRegion",
    "WeightsFile",
    "WeightsFileError",
    "WeightsHeader",
    "pack_module",
    "page_cache_fraction",
    "plan_layout",
    "read_header",
    "read_offload_manifest",
    "read_weights_manifest",
    "wait_for_weights_verified",
    "warm_page_cache",
    "warm_weights",
    "weights_check_pending",
    "write_weights_manifest",
]

MAGIC: Final = b"DSWEIGHT"
FORMAT_VERSION: Final = 2  # written for encoded data; raw data is still written as version 1
_VERSIONS_READ: Final = (1, 2)
FORMAT_NAME: Final = "dynamo-snapshot-weights"
PREFIX_BYTES: Final = 128
_PREFIX = struct.Struct("<8sIIQQQ32s")
# O_DIRECT needs buffer address, file offset and length aligned to the logical block size; a page
# covers 512 B and 4 KiB sectors alike.
ALIGN: Final = 4096
DEFAULT_TENSOR_ALIGNMENT: Final = 256
DEFAULT_CHUNK_BYTES: Final = 64 << 20
DEFAULT_BLOCK_BYTES: Final = 64 << 20
_MAX_HEADER_BYTES: Final = 256 << 20
_MANIFEST_VERSION: Final = 2
_MANIFEST_VERSIONS_READ: Final = (1, 2)
_SHA256_SUFFIX: Final = ".sha256"
# load(direct=None) reads through the page cache when at least this much of the file is in it (the
# agent warmed it): O_DIRECT would ignore those pages and go to the disk again.
_RESIDENT_FOR_BUFFERED: Final = 0.5
ENCODING_RAW: Final = "raw"
ENCODING_SPLIT_NIBBLE: Final = "split-nibble"
ENCODINGS: Final = (ENCODING_RAW, ENCODING_SPLIT_NIBBLE)
NIBBLE_TABLE: Final = 16
NIBBLE_ESCAPE: Final = 15
# A chunk with more escapes than 1/this of its odd bytes is stored plain.
_ESCAPE_LIMIT: Final = 16


class WeightsFileError(ValueError):
    """A weights file is not in this format, is damaged, or does not match the region."""


# ---- layout ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a weight region: where its bytes are and how to view them."""

    name: str
    dtype: str  # torch dtype without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


def plan_layout(
    tensors: Iterable[tuple[str, str, Sequence[int], int]], alignment: int = DEFAULT_TENSOR_ALIGNMENT
) -> tuple[list[TensorSpec], int]:
    """Place (name, dtype, shape, nbytes) entries one after the other, each at an `alignment`
    boundary, in the given order; (specs, end) where end is the first byte after the last tensor."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    end = 0
    for name, dtype, shape, nbytes in tensors:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        if nbytes < 0 or any(int(s) < 0 for s in shape):
            raise ValueError(f"{name}: negative size")
        seen.add(name)
        offset = round_up(end, alignment)
        specs.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), offset, nbytes))
        end = offset + nbytes
    return specs, end


# ---- header ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoding:
    """How a version 2 file stores its data: `escapes[i]` of chunk i (-1: stored plain)."""

    name: str
    escapes: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "escapes": list(self.escapes)}


def coded_record_bytes(nbytes: int, escapes: int) -> int:
    """Length of a split-nibble record of a chunk of `nbytes` with `escapes`, before its padding."""
    half = nbytes // 2
    return half + half // 2 + NIBBLE_TABLE + 5 * escapes


def escape_limit(nbytes: int) -> int:
    """The most escapes a chunk of `nbytes` may have and still be stored split-nibble."""
    return nbytes // 2 // _ESCAPE_LIMIT


@dataclass(frozen=True)
class ChunkRecord:
    """Where chunk `index` (region[data_offset:+nbytes]) is in the data section, and how it is stored:
    plain (escapes -1: its nbytes at `offset`) or as a split-nibble record with `escapes`."""

    index: int
    data_offset: int
    nbytes: int
    offset: int
    escapes: int = -1

    @property
    def coded(self) -> bool:
        return self.escapes >= 0

    @property
    def stored(self) -> int:
        return round_up(coded_record_bytes(self.nbytes, self.escapes), ALIGN) if self.coded else self.nbytes


@dataclass(frozen=True)
class WeightsHeader:
    tensors: tuple[TensorSpec, ...]
    data_bytes: int
    device_bytes: int
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]
    data_digest: str
    alignment: int = DEFAULT_TENSOR_ALIGNMENT
    encoding: Encoding | None = None

    @property
    def version(self) -> int:
        return 1 if self.encoding is None else FORMAT_VERSION

    def records(self) -> list[ChunkRecord]:
        """Every chunk's place in the data section, in order."""
        out = []
        at = 0
        for i, (off, n) in enumerate(_spans(self.data_bytes, self.chunk_bytes)):
            if self.encoding is None:
                rec = ChunkRecord(i, off, n, off)
            else:
                rec = ChunkRecord(i, off, n, at, self.encoding.escapes[i])
            out.append(rec)
            at += rec.stored
        return out

    @property
    def stored_bytes(self) -> int:
        """Bytes of the data section in the file."""
        if self.encoding is None:
            return self.data_bytes
        return sum(r.stored for r in self.records())

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT_NAME,
            "version": self.version,
            "alignment": self.alignment,
            "tensors": [t.to_json() for t in self.tensors],
            "data_bytes": self.data_bytes,
            "device_bytes": self.device_bytes,
            "chunk_bytes": self.chunk_bytes,
            "chunk_sha256": list(self.chunk_sha256),
            "data_digest": self.data_digest,
        }
        if self.encoding is not None:
            out["encoding"] = self.encoding.to_json()
        return out

    def encode(self) -> bytes:
        """Prefix, JSON and padding: the file's first data_offset bytes."""
        body = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        data_offset = round_up(PREFIX_BYTES + len(body), ALIGN)
        prefix = _PREFIX.pack(
            MAGIC, self.version, 0, len(body), data_offset, self.stored_bytes, hashlib.sha256(body).digest()
        )
        out = bytearray(data_offset)
        out[: len(prefix)] = prefix
        out[PREFIX_BYTES : PREFIX_BYTES + len(body)] = body
        return bytes(out)


def data_digest(chunk_digests: Iterable[str]) -> str:
    """The digest of a data section from its chunks' SHA-256 (hex): SHA-256 of the raw digests."""
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def _int_field(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WeightsFileError(f"header field {key!r} is not a non-negative integer: {value!r}")
    return value


def _parse_header(body: bytes) -> WeightsHeader:
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise WeightsFileError(f"header is not JSON: {e}") from None
    if (
        not isinstance(obj, dict)
        or obj.get("format") != FORMAT_NAME
        or obj.get("version") not in _VERSIONS_READ
    ):
        raise WeightsFileError("header names another format or version")
    raw_tensors = obj.get("tensors")
    chunks = obj.get("chunk_sha256")
    digest = obj.get("data_digest")
    if not isinstance(raw_tensors, list) or not isinstance(chunks, list) or not isinstance(digest, str):
        raise WeightsFileError("header lacks tensors, chunk_sha256 or data_digest")
    tensors = []
    for t in raw_tensors:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)):
            raise WeightsFileError(f"bad tensor entry {t!r}")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WeightsFileError(f"bad shape in {t!r}")
        tensors.append(
            TensorSpec(t["name"], t["dtype"], tuple(shape), _int_field(t, "offset"), _int_field(t, "nbytes"))
        )
    header = WeightsHeader(
        tensors=tuple(tensors),
        data_bytes=_int_field(obj, "data_bytes"),
        device_bytes=_int_field(obj, "device_bytes"),
        chunk_bytes=_int_field(obj, "chunk_bytes"),
        chunk_sha256=tuple(str(c) for c in chunks),
        data_digest=digest,
        alignment=_int_field(obj, "alignment"),
        encoding=_parse_encoding(obj),
    )
    # The layout must be exactly what plan_layout makes of it: offsets are then aligned, in order and
    # non-overlapping, and the data section covers every tensor.
    try:
        replanned, end = plan_layout(
            ((t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors), header.alignment
        )
    except ValueError as e:
        raise WeightsFileError(f"bad layout: {e}") from None
    if tuple(replanned) != header.tensors or round_up(end, ALIGN) != header.data_bytes:
        raise WeightsFileError("tensor layout in the header is inconsistent")
    if header.chunk_bytes <= 0 or header.chunk_bytes % ALIGN:
        raise WeightsFileError(f"chunk_bytes {header.chunk_bytes} is not a positive multiple of {ALIGN}")
    if len(header.chunk_sha256) != -(-header.data_bytes // header.chunk_bytes):
        raise WeightsFileError("chunk_sha256 does not have one digest per chunk")
    if data_digest(header.chunk_sha256) != header.data_digest:
        raise WeightsFileError("data_digest does not match chunk_sha256")
    if header.device_bytes < header.data_bytes:
        raise WeightsFileError("device_bytes is smaller than data_bytes")
    if header.encoding is not None:
        escapes = header.encoding.escapes
        if len(escapes) != len(header.chunk_sha256):
            raise WeightsFileError("encoding does not give escapes for every chunk")
        spans = _spans(header.data_bytes, header.chunk_bytes)
        if any(k < -1 or k > escape_limit(n) for k, (_, n) in zip(escapes, spans, strict=True)):
            raise WeightsFileError("encoding's escape counts do not fit the chunks")
    return header


def _parse_encoding(obj: Mapping[str, Any]) -> Encoding | None:
    version, raw = obj.get("version"), obj.get("encoding")
    if version == 1:
        if raw is not None:
            raise WeightsFileError("a version 1 header has no encoding")
        return None
    if not isinstance(raw, dict) or raw.get("name") != ENCODING_SPLIT_NIBBLE:
        raise WeightsFileError(f"unknown encoding {raw.get('name') if isinstance(raw, dict) else raw!r}")
    escapes = raw.get("escapes")
    if not isinstance(escapes, list) or not all(
        isinstance(k, int) and not isinstance(k, bool) for k in escapes
    ):
        raise WeightsFileError("encoding escapes is not a list of integers")
    return Encoding(ENCODING_SPLIT_NIBBLE, tuple(escapes))


def read_header(path: Path | str) -> tuple[WeightsHeader, int]:
    """(header, data offset) of a weights file, after checking the magic, version, header checksum
    and that the file's size is exactly data offset + data bytes. WeightsFileError otherwise."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX_BYTES)
        if len(prefix) < PREFIX_BYTES:
            raise WeightsFileError(f"{path}: too short for a weights file")
        magic, version, _flags, header_len, data_offset, data_bytes, header_sha = _PREFIX.unpack_from(prefix)
        if magic != MAGIC:
            raise WeightsFileError(f"{path}: not a weights file (magic {magic!r})")
        if version not in _VERSIONS_READ:
            raise WeightsFileError(f"{path}: format version {version}, this code reads {_VERSIONS_READ}")
        if (
            header_len > _MAX_HEADER_BYTES
            or data_offset % ALIGN
            or data_offset < PREFIX_BYTES + header_len
            or data_bytes % ALIGN
        ):
            raise WeightsFileError(f"{path}: inconsistent prefix")
        body = f.read(header_len)
        if len(body) != header_len or hashlib.sha256(body).digest() != header_sha:
            raise WeightsFileError(f"{path}: header checksum mismatch")
        size = os.fstat(f.fileno()).st_size
    header = _parse_header(body)
    if header.stored_bytes != data_bytes or header.version != version:
        raise WeightsFileError(f"{path}: prefix and header disagree on the version or data size")
    if size != data_offset + data_bytes:
        raise WeightsFileError(
            f"{path}: {size} bytes, expected {data_offset + data_bytes} (truncated or appended to)"
        )
    return header, data_offset


# ---- the split-nibble encoding, in plain Python (the TransferEngine's GPU does the same) -----------


def nibble_table(odd: bytes | memoryview) -> bytes:
    """The 15 odd bytes a chunk's codes stand for: most frequent first, a tie the smaller first."""
    counts = Counter(bytes(odd))
    order = sorted(range(256), key=lambda v: (-counts.get(v, 0), v))
    return bytes(order[:NIBBLE_ESCAPE])


def _codes_of(table: bytes) -> bytes:
    lut = bytearray([NIBBLE_ESCAPE]) * 256
    for code, value in enumerate(table):
        lut[value] = code
    return bytes(lut)


def _nibble_mask(nbytes: int, value: int) -> int:
    return int.from_bytes(bytes([value]) * nbytes, "little")


def _nibble_codes(odd: bytes) -> tuple[bytes, bytes, list[int]]:
    """(table, each odd byte's code, the escapes' positions) of a chunk's odd bytes."""
    table = nibble_table(odd)
    codes = odd.translate(_codes_of(table))
    return table, codes, [i for i, c in enumerate(codes) if c == NIBBLE_ESCAPE]


def count_escapes(data: bytes | memoryview) -> int:
    """The escapes a chunk's split-nibble record has (TransferEngine.count_escapes, in plain Python)."""
    return len(_nibble_codes(bytes(data)[1::2])[2])


def encode_coded(data: bytes | memoryview) -> bytes | None:
    """The split-nibble record (unpadded) of a chunk, or None where it has too many escapes."""
    data = bytes(data)
    n = len(data)
    if n % 4:
        raise ValueError(f"a split-nibble chunk is a multiple of 4 bytes, not {n}")
    even, odd = data[0::2], data[1::2]
    table, codes, positions = _nibble_codes(odd)
    if len(positions) > escape_limit(n):
        return None
    quarter = n // 4
    packed = int.from_bytes(codes[:quarter], "little") | int.from_bytes(codes[quarter:], "little") << 4
    return b"".join(
        [
            even,
            packed.to_bytes(quarter, "little"),
            table + bytes(NIBBLE_TABLE - len(table)),
            struct.pack(f"<{len(positions)}I", *positions),
            bytes(odd[i] for i in positions),
        ]
    )


def decode_coded(record: bytes | memoryview, nbytes: int, escapes: int) -> bytes:
    """The chunk of `nbytes` a split-nibble record with `escapes` holds."""
    record = bytes(record[: coded_record_bytes(nbytes, escapes)])
    half, quarter = nbytes // 2, nbytes // 4
    packed = int.from_bytes(record[half : half + quarter], "little")
    codes = (packed & _nibble_mask(quarter, 0x0F)).to_bytes(quarter, "little") + (
        (packed >> 4) & _nibble_mask(quarter, 0x0F)
    ).to_bytes(quarter, "little")
    at = half + quarter
    table = record[at : at + NIBBLE_TABLE]
    odd = bytearray(codes.translate(table + bytes(256 - NIBBLE_TABLE)))
    at += NIBBLE_TABLE
    positions = struct.unpack_from(f"<{escapes}I", record, at)
    values = record[at + 4 * escapes : at + 5 * escapes]
    for i, v in zip(positions, values, strict=True):
        if i >= half:
            raise WeightsFileError(f"an escape's position {i} is outside its chunk")
        odd[i] = v
    out = bytearray(nbytes)
    out[0::2] = record[:half]
    out[1::2] = odd
    return bytes(out)


# ---- moving bytes between the region and host memory ---------------------------------------------


class HostBuffer(Protocol):
    """Host memory a TransferEngine copies from and to; view() is writable and 1-D of bytes."""

    @property
    def nbytes(self) -> int: ...

    @property
    def aligned(self) -> bool:
        """Its address is a multiple of ALIGN (O_DIRECT may read into it)."""
        ...

    def view(self) -> memoryview: ...


class TransferEngine(Protocol):
    """Copies between one region and host buffers it allocates. Called from one thread only."""

    def host_buffer(self, nbytes: int) -> HostBuffer: ...

    def download(self, offset: int, buf: HostBuffer, nbytes: int) -> None:
        """region[offset:offset+nbytes] -> buf[:nbytes]; returns once the bytes are there."""
        ...

    def upload(self, buf: HostBuffer, nbytes: int, offset: int) -> None:
        """buf[:nbytes] -> region[offset:]; may return before the copy is done."""
        ...

    def count_escapes(self, offset: int, nbytes: int) -> int:
        """The escapes a split-nibble record of region[offset:+nbytes] has (nbytes a multiple of 4)."""
        ...

    def download_coded(self, offset: int, buf: HostBuffer, nbytes: int) -> int:
        """region[offset:+nbytes] as a split-nibble record into buf (which holds the longest one,
        coded_record_bytes(nbytes, escape_limit(nbytes))); its length. Only for a chunk whose escapes
        are within escape_limit."""
        ...

    def upload_coded(self, buf: HostBuffer, nbytes: int, offset: int, escapes: int) -> None:
        """Like upload, from the split-nibble record of region[offset:+nbytes] that buf holds."""
        ...

    def wait_upload(self, buf: HostBuffer) -> None:
        """Until the last upload from `buf` is done (then `buf` may be overwritten)."""
        ...

    def finish(self) -> None:
        """Until every upload is done."""
        ...

    def close(self) -> None:
        """finish(), then free the host buffers."""
        ...


EngineFactory = Callable[[VmmRegion], TransferEngine]


class MmapBuffer:
    """Anonymous, page-aligned host memory (mmap), viewed as bytes."""

    def __init__(self, nbytes: int) -> None:
        self._mmap = mmap.mmap(-1, max(nbytes, 1))
        anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping does; the export must not linger
        self._view = memoryview(self._mmap)[:nbytes]
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def aligned(self) -> bool:
        return self.address % ALIGN == 0

    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        self._view.release()
        # A slice still held somewhere (a traceback) keeps the mapping; the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._mmap.close()


class _PinnedBuffer(MmapBuffer):
    """An MmapBuffer registered with CUDA (page-locked) and wrapped as a CPU tensor for copy_()."""

    def __init__(self, torch: Any, nbytes: int, device: int, driver: Any) -> None:
        super().__init__(nbytes)
        self._device = device
        self._driver = driver
        register_host_memory(self.address, len(self._mmap), device, driver=driver)
        self._registered = True
        # frombuffer shares the memory (no copy, no NumPy).
        self.tensor: Any = torch.frombuffer(self._mmap, dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        self.tensor = None
        if self._registered:
            self._registered = False
            unregister_host_memory(self.address, self._device, driver=self._driver)
        super().close()


class _TorchEngine:
    """Copies on a dedicated CUDA stream, between the region and page-locked host buffers (so the
    host-to-device copies are asynchronous DMA)."""

    def __init__(self, region: VmmRegion) -> None:
        torch = _import_torch()
        self._torch = torch
        self._region = region
        self._device = torch.device("cuda", region.device)
        with torch.cuda.device(self._device):
            # Work queued earlier on other streams (pack's copies, the model) must not race a download.
            torch.cuda.synchronize(self._device)
            self._stream = torch.cuda.Stream(device=self._device)
        self._flat: Any = region.as_tensor(torch.uint8, (region.size,))
        self._events: dict[int, Any] = {}
        self._buffers: list[_PinnedBuffer] = []
        # Device memory the planes pass through; one suffices, as every copy runs on self._stream.
        # A region of its own (not torch's cache), so closing gives it back to the driver.
        self._scratch: VmmRegion | None = None
        self._scratch_flat: Any = None
        self._coded = False

    def _scratch_tensor(self, nbytes: int) -> Any:
        if self._scratch is None or self._scratch.size < nbytes:
            self._free_scratch()
            self._scratch = VmmRegion(nbytes, self._region.device, driver=self._region.driver)
            self._scratch_flat = self._scratch.as_tensor(self._torch.uint8, (self._scratch.size,))
        return self._scratch_flat[:nbytes]

    def _free_scratch(self) -> None:
        self._scratch_flat = None
        if self._scratch is not None:
            self._stream.synchronize()  # copies queued on it may still use the old scratch
            self._scratch.free()
            self._scratch = None

    def _pinned(self, buf: HostBuffer) -> _PinnedBuffer:
        if not isinstance(buf, _PinnedBuffer):
            raise TypeError(f"not a buffer of this engine: {buf!r}")
        return buf

    def host_buffer(self, nbytes: int) -> HostBuffer:
        buf = _PinnedBuffer(self._torch, nbytes, self._region.device, self._region.driver)
        self._buffers.append(buf)
        return buf

    def download(self, offset: int, buf: HostBuffer, nbytes: int) -> None:
        torch = self._torch
        src = self._flat[offset : offset + nbytes]
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._pinned(buf).tensor[:nbytes].copy_(src, non_blocking=True)
        self._stream.synchronize()

    def upload(self, buf: HostBuffer, nbytes: int, offset: int) -> None:
        torch = self._torch
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._flat[offset : offset + nbytes].copy_(self._pinned(buf).tensor[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[id(buf)] = event

    # Split-nibble records are made and expanded here, on the GPU, in the scratch:
    # [planes: even | odd, n][record, n][codes, n/2][lookup indices, int32 x _LOOKUP]
    def _coding_scratch(self, nbytes: int) -> tuple[Any, Any, Any, Any]:
        sc = self._scratch_tensor(2 * nbytes + nbytes // 2 + 4 * _LOOKUP)
        rec_end = 2 * nbytes
        codes_end = rec_end + nbytes // 2
        return sc[:nbytes], sc[nbytes:rec_end], sc[rec_end:codes_end], sc[codes_end:].view(self._torch.int32)

    def _split(self, offset: int, nbytes: int, planes: Any) -> None:
        half = nbytes // 2
        planes.view(2, half).copy_(self._flat[offset : offset + nbytes].view(half, 2).t())

    def count_escapes(self, offset: int, nbytes: int) -> int:
        torch = self._torch
        self._coded = True
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, _, _, _ = self._coding_scratch(nbytes)
            self._split(offset, nbytes, planes)
            _, escapes = _nibble_table_of(torch, planes[nbytes // 2 :])
            count = int(escapes)
        return count

    def download_coded(self, offset: int, buf: HostBuffer, nbytes: int) -> int:
        torch = self._torch
        self._coded = True
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, rec, codes, idx = self._coding_scratch(nbytes)
            self._split(offset, nbytes, planes)
            length = _encode_coded_on(torch, planes, rec, codes, idx)
            self._pinned(buf).tensor[:length].copy_(rec[:length], non_blocking=True)
        self._stream.synchronize()
        return length

    def upload_coded(self, buf: HostBuffer, nbytes: int, offset: int, escapes: int) -> None:
        torch = self._torch
        half = nbytes // 2
        length = coded_record_bytes(nbytes, escapes)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, rec, codes, idx = self._coding_scratch(nbytes)
            rec[:length].copy_(self._pinned(buf).tensor[:length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)  # the pinned buffer is free from here on
            odd = planes[half:]
            _decode_coded_on(torch, rec, nbytes, escapes, odd, codes, idx)
            dst = self._flat[offset : offset + nbytes].view(half, 2)
            dst[:, 0].copy_(rec[:half])
            dst[:, 1].copy_(odd)
        self._events[id(buf)] = event

    def wait_upload(self, buf: HostBuffer) -> None:
        event = self._events.pop(id(buf), None)
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        self._stream.synchronize()
        self._events.clear()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            # Unpinned and unmapped now: nothing of them is left to be checkpointed with the process.
            buffers, self._buffers = self._buffers, []
            self._flat = None
            self._free_scratch()
            for buf in buffers:
                buf.close()
            if self._coded:
                # Making records left small temporaries in torch's cache; a save comes right before a
                # checkpoint, which would copy them.
                self._torch.cuda.empty_cache()


# The lookup from codes to odd bytes runs in pieces of this many: its int32 indices stay small.
_LOOKUP: Final = 4 << 20


def _nibble_table_of(torch: Any, odd: Any) -> tuple[Any, Any]:
    """(table, escapes) of an odd plane (uint8 tensor), as nibble_table and encode_coded make them:
    the 15 most frequent bytes, a tie the smaller first."""
    counts = torch.bincount(odd, minlength=256)
    # Unique keys, so topk's order is the format's: more frequent first, then the smaller byte.
    key = counts * 256 + (255 - torch.arange(256, device=odd.device))
    table = key.topk(NIBBLE_ESCAPE).indices
    return table, odd.numel() - counts[table].sum()


def _lookup(torch: Any, table: Any, codes: Any, out: Any, idx: Any) -> None:
    """out[i] = table[codes[i]], through int32 indices a piece at a time (no big temporaries)."""
    for start in range(0, codes.numel(), _LOOKUP):
        end = min(start + _LOOKUP, codes.numel())
        part = idx[: end - start]
        part.copy_(codes[start:end])
        torch.index_select(table, 0, part, out=out[start:end])


def _encode_coded_on(torch: Any, planes: Any, rec: Any, codes: Any, idx: Any) -> int:
    """encode_coded with tensors: planes (even | odd of a chunk) -> rec; the record's length."""
    n = int(planes.numel())
    half, quarter = n // 2, n // 4
    even, odd = planes[:half], planes[half:]
    table, escapes = _nibble_table_of(torch, odd)
    lut = torch.full((256,), NIBBLE_ESCAPE, dtype=torch.uint8, device=odd.device)
    lut[table] = torch.arange(NIBBLE_ESCAPE, dtype=torch.uint8, device=odd.device)
    _lookup(torch, lut, odd, codes[:half], idx)
    rec[:half].copy_(even)
    packed = rec[half : half + quarter]
    torch.bitwise_left_shift(codes[quarter:half], 4, out=packed)
    packed.bitwise_or_(codes[:quarter])
    at = half + quarter
    rec[at : at + NIBBLE_ESCAPE].copy_(table)
    rec[at + NIBBLE_ESCAPE : at + NIBBLE_TABLE].zero_()
    at += NIBBLE_TABLE
    k = int(escapes)
    if k:
        positions = (codes[:half] == NIBBLE_ESCAPE).nonzero().flatten()
        rec[at : at + 4 * k].view(torch.int32).copy_(positions)
        rec[at + 4 * k : at + 5 * k].copy_(odd[positions])
    return at + 5 * k


def _decode_coded_on(torch: Any, rec: Any, n: int, escapes: int, odd: Any, codes: Any, idx: Any) -> None:
    """decode_coded with tensors: the odd plane of the record `rec` into `odd`."""
    half, quarter = n // 2, n // 4
    packed = rec[half : half + quarter]
    torch.bitwise_and(packed, 0x0F, out=codes[:quarter])
    torch.bitwise_right_shift(packed, 4, out=codes[quarter:half])
    at = half + quarter
    _lookup(torch, rec[at : at + NIBBLE_TABLE], codes[:half], odd, idx)
    at += NIBBLE_TABLE
    if escapes:
        # Clamped: a damaged file must give wrong bytes (which the agent's digest check refuses), never
        # an out-of-bounds write on the GPU (which would take the worker's CUDA context down).
        positions = rec[at : at + 4 * escapes].view(torch.int32).clamp_(0, half - 1)
        odd.index_put_((positions,), rec[at + 4 * escapes : at + 5 * escapes])


# ---- files ----------------------------------------------------------------------------------------


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def page_cache_fraction(path: Path | str) -> float | None:
    """How much of the file is in the page cache (0..1), from mincore(2); None where it cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        libc = _libc()
        libc.mmap.restype = ctypes.c_void_p
        c = ctypes
        libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            flags = bytes(vec)
            resident = pages - flags.count(0)
            return resident / pages
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


class _Reader:
    """Reads pieces of one file, through O_DIRECT while the kernel accepts it, else buffered."""

    def __init__(self, path: Path, direct: bool) -> None:
        self._buffered = os.open(path, os.O_RDONLY)
        self._direct: int | None = None
        if direct:
            try:
                self._direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                # EINVAL is how a filesystem without O_DIRECT (tmpfs, some overlays) answers.
                if e.errno != errno.EINVAL:
                    raise
        self._use_direct = self._direct is not None
        self.fell_back = False

    @property
    def direct(self) -> bool:
        """Whether every read so far went through O_DIRECT."""
        return self._use_direct and not self.fell_back

    def read(self, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; bytes read (fewer only at end of file)."""
        got = 0
        want = len(view)
        while got < want:
            fd = self._direct if self._use_direct and self._direct is not None else self._buffered
            try:
                with view[got:] as part:
                    n = os.preadv(fd, [part], offset + got)
            except OSError as e:
                if fd == self._direct and e.errno == errno.EINVAL:
                    # A read the kernel would not do directly (alignment it requires beyond ours):
                    # every later read goes buffered. The fd stays open: other threads may be in it.
                    self._use_direct = False
                    self.fell_back = True
                    continue
                raise
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        os.close(self._buffered)
        if self._direct is not None:
            os.close(self._direct)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        with view[done:] as part:
            done += os.pwrite(fd, part, offset + done)


def _sha256_hex(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SHA256_SUFFIX)


def _read_sidecar(path: Path) -> str | None:
    """The whole-file SHA-256 from FILE.sha256 when it is there and not older than the file."""
    side = _sidecar(path)
    try:
        if side.stat().st_mtime_ns < path.stat().st_mtime_ns:
            return None
        text = side.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(text) == 2 and text[1] == path.name and len(text[0]) == 64:
        try:
            bytes.fromhex(text[0])
        except ValueError:
            return None
        return text[0].lower()
    return None


def _sha256_file(path: Path, block: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class WarmResult:
    path: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def warm_page_cache(path: Path | str, *, threads: int = 8, block: int = 16 << 20) -> WarmResult:
    """Read the file through the page cache with `threads` parallel readers so that a later load()
    finds it in memory: for the node agent, while CRIU restores the worker."""
    started = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)

        def read_range(first: int) -> int:
            buf = bytearray(block)
            done = 0
            # Strided: thread k reads blocks k, k + threads, ...; all of them sweep the file forward.
            for offset in range(first * block, size, threads * block):
                done += os.preadv(fd, [buf], offset)
            return done

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weights-warm") as pool:
            total = sum(pool.map(read_range, range(threads)))
    finally:
        os.close(fd)
    return WarmResult(str(path), total, time.monotonic() - started)


# ---- the control-directory manifest ---------------------------------------------------------------


@dataclass(frozen=True)
class WeightsFile:
    """One weights file as weights.json lists it."""

    path: str  # absolute, as the worker sees it
    bytes: int  # file size
    sha256: str  # of the whole file (what FILE.sha256 and `sha256sum` give)
    data_digest: str  # the header's digest of the data section
    device: int  # CUDA device ordinal of the region


@dataclass(frozen=True)
class OffloadManifest:
    """What FILE_WEIGHTS_MANIFEST says: the weights files, and the GPU memory the worker released before
    the checkpoint and maps again after the restore (bytes per CUDA device ordinal)."""

    files: list[WeightsFile] = field(default_factory=list)
    released_bytes: dict[int, int] = field(default_factory=dict)
    # The worker waits for FILE_WEIGHTS_VERIFIED before it serves, so the agent may let it load the
    # weights while it still checks them (absent in manifests of older SDKs: False).
    waits_for_weights_check: bool = False


def write_weights_manifest(
    control_dir: Path | str,
    files: Sequence[WeightsFile],
    released_bytes: Mapping[int, int] | None = None,
    *,
    waits_for_weights_check: bool = False,
) -> Path:
    """Write FILE_WEIGHTS_MANIFEST into the control directory (atomically); its path."""
    path = Path(control_dir) / FILE_WEIGHTS_MANIFEST
    doc = {
        "version": _MANIFEST_VERSION,
        "files": [asdict(f) for f in files],
        "released_bytes": {str(d): int(n) for d, n in sorted((released_bytes or {}).items())},
        "waits_for_weights_check": waits_for_weights_check,
    }
    _write_atomic(path, json.dumps(doc, sort_keys=True, indent=1).encode())
    return path


def read_offload_manifest(control_dir: Path | str) -> OffloadManifest | None:
    """FILE_WEIGHTS_MANIFEST of the control directory; None when there is none. ValueError if damaged."""
    path = Path(control_dir) / FILE_WEIGHTS_MANIFEST
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or doc.get("version") not in _MANIFEST_VERSIONS_READ:
        raise ValueError(f"{path}: not a version {_MANIFEST_VERSION} weights manifest")
    out = []
    for entry in files:
        try:
            out.append(
                WeightsFile(
                    path=str(entry["path"]),
                    bytes=int(entry["bytes"]),
                    sha256=str(entry["sha256"]),
                    data_digest=str(entry["data_digest"]),
                    device=int(entry["device"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad entry {entry!r}") from None
    released = doc.get("released_bytes", {})
    try:
        released_bytes = {int(d): int(n) for d, n in released.items()}
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"{path}: bad released_bytes {released!r}") from None
    if any(d < 0 or n < 0 for d, n in released_bytes.items()):
        raise ValueError(f"{path}: negative released_bytes {released!r}")
    waits = doc.get("waits_for_weights_check", False)
    if not isinstance(waits, bool):
        raise ValueError(f"{path}: waits_for_weights_check must be true or false, not {waits!r}")
    return OffloadManifest(out, released_bytes, waits)


def weights_check_pending(content: Any) -> bool:
    """Whether restore-complete's content says the agent is still checking the weights."""
    return isinstance(content, Mapping) and content.get(RESTORE_WEIGHTS_CHECK) == WEIGHTS_CHECK_PENDING


def wait_for_weights_verified(
    control_dir: Path | str, *, timeout: float | None = None, poll: float = 0.005
) -> float:
    """Block until the agent wrote FILE_WEIGHTS_VERIFIED; the seconds waited. No timeout by default:
    the agent stops this worker when the check fails (or when it restarts during the restore), and a
    check of a big file on slow storage may take long; with ``timeout``, TimeoutError after that many
    seconds, never serving weights nobody checked."""
    path = Path(control_dir) / FILE_WEIGHTS_VERIFIED
    started = time.monotonic()
    while not path.exists():
        waited = time.monotonic() - started
        if timeout is not None and waited > timeout:
            raise TimeoutError(f"the node agent did not confirm the weights within {timeout:.0f}s ({path})")
        time.sleep(poll)
    return time.monotonic() - started


def read_weights_manifest(control_dir: Path | str) -> list[WeightsFile]:
    """The weights files FILE_WEIGHTS_MANIFEST lists; [] when there is none. ValueError if damaged."""
    manifest = read_offload_manifest(control_dir)
    return manifest.files if manifest is not None else []


def warm_weights(control_dir: Path | str, *, threads: int = 8) -> list[WarmResult]:
    """warm_page_cache for every file the control directory's weights.json lists (missing files are
    skipped: the restore will fail on them with a clearer error)."""
    return [
        warm_page_cache(f.path, threads=threads)
        for f in read_weights_manifest(control_dir)
        if os.path.exists(f.path)
    ]


# ---- results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    path: str
    bytes: int  # file size
    data_bytes: int
    sha256: str  # of the whole file
    data_digest: str
    written: bool  # False: an identical file was there already
    seconds: float  # in total
    digest_seconds: float  # reading the region and hashing its chunks
    write_seconds: float

    def manifest_entry(self, device: int) -> WeightsFile:
        return WeightsFile(self.path, self.bytes, self.sha256, self.data_digest, device)

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


# ---- pipelines ------------------------------------------------------------------------------------


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(off, min(step, total - off)) for off in range(0, total, step)]


def _chunk_digests(
    engine: TransferEngine, bufs: Sequence[HostBuffer], data_bytes: int, chunk: int, threads: int
) -> list[str]:
    """SHA-256 of each `chunk` of region[0:data_bytes]: downloads in order, hashes in parallel."""
    spans = _spans(data_bytes, chunk)
    busy: dict[int, Future[str]] = {}
    futures: list[Future[str]] = []
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-hash") as pool:
        for i, (off, n) in enumerate(spans):
            b = i % len(bufs)
            if b in busy:
                busy.pop(b).result()  # the buffer is free once its hash is done
            engine.download(off, bufs[b], n)
            fut = pool.submit(_sha256_hex, bufs[b].view()[:n])
            busy[b] = fut
            futures.append(fut)
        return [f.result() for f in futures]


def _chunk_escapes(engine: TransferEngine, data_bytes: int, chunk: int) -> list[int]:
    """Each chunk's escapes as a split-nibble record, -1 where it is to be stored plain."""
    out = []
    for off, n in _spans(data_bytes, chunk):
        k = engine.count_escapes(off, n)
        out.append(k if k <= escape_limit(n) else -1)
    return out


def _coded_sha256(record: memoryview, nbytes: int, escapes: int) -> str:
    return hashlib.sha256(decode_coded(record, nbytes, escapes)).hexdigest()


def _write_file(
    path: Path,
    engine: TransferEngine,
    bufs: Sequence[HostBuffer],
    head: bytes,
    records: Sequence[ChunkRecord],
    threads: int,
) -> str:
    """Write `head` then every chunk record to `path` (created); the whole file's SHA-256.

    Downloads (coded records: made by the engine) in order; each record is hashed in file order by one
    thread and written by another, so hashing, writing and the next download overlap.
    """
    file_hash = hashlib.sha256(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(head), 0)
        busy: dict[int, tuple[Future[None], Future[None]]] = {}
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-sha") as hasher,
            ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-write") as writers,
        ):
            for i, rec in enumerate(records):
                b = i % len(bufs)
                if b in busy:
                    for fut in busy.pop(b):
                        fut.result()
                view = bufs[b].view()
                if rec.coded:
                    length = engine.download_coded(rec.data_offset, bufs[b], rec.nbytes)
                    if length != coded_record_bytes(rec.nbytes, rec.escapes):
                        # The header (written first) would not describe this record: never write that.
                        raise WeightsFileError(f"chunk {rec.index} coded to {length} bytes, not as counted")
                    view[length : rec.stored] = bytes(rec.stored - length)
                else:
                    engine.download(rec.data_offset, bufs[b], rec.nbytes)
                part = view[: rec.stored]
                busy[b] = (
                    hasher.submit(file_hash.update, part),
                    writers.submit(_pwrite_all, fd, part, len(head) + rec.offset),
                )
            for pair in busy.values():
                for fut in pair:
                    fut.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return file_hash.hexdigest()


def _read_into_region(
    reader: _Reader,
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


# ---- the region -----------------------------------------------------------------------------------


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
        self._engine: EngineFactory = engine if engine is not None else _TorchEngine
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
        """Write the region to `path` (and its SHA-256 to PATH.sha256), unless a file with the same
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
            digests = _chunk_digests(engine, bufs, self.data_bytes, chunk_bytes, threads)
            enc = None
            if encoding == ENCODING_SPLIT_NIBBLE:
                escapes = _chunk_escapes(engine, self.data_bytes, chunk_bytes)
                enc = Encoding(ENCODING_SPLIT_NIBBLE, tuple(escapes))
            header = self._header(digests, chunk_bytes, enc)
            head = header.encode()
            hashed = time.monotonic()
            written = not _same_file(path, header, len(head))
            if written:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                try:
                    sha = _write_file(tmp, engine, bufs, head, header.records(), threads)
                    os.replace(tmp, path)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                _fsync_dir(path.parent)
            else:
                sha = _read_sidecar(path) or _sha256_file(path)
        finally:
            engine.close()
        if written or _read_sidecar(path) != sha:
            _write_atomic(_sidecar(path), f"{sha}  {path.name}\n".encode())
        done = time.monotonic()
        return SaveResult(
            path=str(path),
            bytes=len(head) + header.stored_bytes,
            data_bytes=self.data_bytes,
            sha256=sha,
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
        """
        if threads <= 0 or buffers <= 0:
            raise ValueError("threads and buffers must be positive")
        if block <= 0 or block % ALIGN:
            raise ValueError(f"block must be a positive multiple of {ALIGN}")
        path = Path(path).absolute()
        header, data_offset = read_header(path)
        if self.region is None:
            self.alignment = header.alignment
            self.allocate((t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors)
        assert self.region is not None
        assert self._specs is not None
        if tuple(self._specs) != header.tensors or header.data_bytes != self.data_bytes:
            raise WeightsFileError(f"{path}: its tensor layout is not this region's")
        if verify or header.encoding is not None:
            block = header.chunk_bytes
            records = header.records()
        else:
            records = [
                ChunkRecord(i, off, n, off) for i, (off, n) in enumerate(_spans(header.data_bytes, block))
            ]
        t0 = time.monotonic()
        self.region.reacquire()
        reacquired = time.monotonic()
        resident = page_cache_fraction(path)
        use_direct = direct if direct is not None else (resident is None or resident < _RESIDENT_FOR_BUFFERED)
        engine = self._engine(self.region)
        try:
            size = min(block, header.data_bytes) if header.data_bytes else ALIGN
            bufs = [engine.host_buffer(size) for _ in range(buffers)]
            reader = _Reader(path, use_direct and all(b.aligned for b in bufs))
            try:
                _read_into_region(
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
        done = time.monotonic()
        return LoadResult(
            path=str(path),
            bytes=header.data_bytes,
            seconds=done - reacquired,
            direct=reader.direct,
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
