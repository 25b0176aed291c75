"""The weights file format (version 1: raw data; version 2: encoded data), all integers little-endian:

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

Encoding "split-nibble" (version 2, see codec) stores each chunk as a record of its even bytes and its
odd bytes as 4-bit codes; chunk_sha256 and data_digest are of the data as on the GPU, whatever the
encoding, so a file's identity does not depend on how it is stored.

Offsets and sizes are multiples of 4096 so O_DIRECT can read the data in place. The per-chunk digests
let a load verify what it reads in parallel (WeightRegion.load(verify=True)).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.fileio import ALIGN, spans
from dynamo_snapshot.workload.gpu_memory import round_up

__all__ = [
    "ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TENSOR_ALIGNMENT",
    "ENCODINGS",
    "ENCODING_RAW",
    "ENCODING_SPLIT_NIBBLE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAGIC",
    "NIBBLE_ESCAPE",
    "NIBBLE_TABLE",
    "PREFIX_BYTES",
    "ChunkRecord",
    "Encoding",
    "TensorSpec",
    "WeightsFileError",
    "WeightsHeader",
    "coded_record_bytes",
    "data_digest",
    "escape_limit",
    "header_span",
    "parse_header",
    "plan_layout",
    "read_header",
]

MAGIC: Final = b"DSWEIGHT"
FORMAT_VERSION: Final = 2  # written for encoded data; raw data is still written as version 1
_VERSIONS_READ: Final = (1, 2)
FORMAT_NAME: Final = "dynamo-snapshot-weights"
PREFIX_BYTES: Final = 128
_PREFIX = struct.Struct("<8sIIQQQ32s")
DEFAULT_TENSOR_ALIGNMENT: Final = 256
DEFAULT_CHUNK_BYTES: Final = 64 << 20
_MAX_HEADER_BYTES: Final = 256 << 20
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
        for i, (off, n) in enumerate(spans(self.data_bytes, self.chunk_bytes)):
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


def parse_header(body: bytes) -> WeightsHeader:
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
        pieces = spans(header.data_bytes, header.chunk_bytes)
        if any(k < -1 or k > escape_limit(n) for k, (_, n) in zip(escapes, pieces, strict=True)):
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


def header_span(prefix: bytes) -> int:
    """The bytes read_header reads of a file that starts with ``prefix`` (its PREFIX_BYTES): the prefix
    and the header it announces; just the prefix where it announces none a reader would accept."""
    if len(prefix) < PREFIX_BYTES:
        return PREFIX_BYTES
    magic, _version, _flags, header_len, *_ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        return PREFIX_BYTES
    return int(PREFIX_BYTES + header_len)


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
    header = parse_header(body)
    if header.stored_bytes != data_bytes or header.version != version:
        raise WeightsFileError(f"{path}: prefix and header disagree on the version or data size")
    if size != data_offset + data_bytes:
        raise WeightsFileError(
            f"{path}: {size} bytes, expected {data_offset + data_bytes} (truncated or appended to)"
        )
    return header, data_offset
