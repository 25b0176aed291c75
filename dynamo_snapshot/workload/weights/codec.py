"""The split-nibble encoding of a weights chunk (format version 2), in plain Python and with torch tensors
on the GPU (the TransferEngine's way: same records, byte for byte).

A chunk of n bytes (h = n/2 odd and h even bytes) is stored as

    [.., +16)                the table: code c < 15 stands for the odd byte table[c]; 15 is an escape
    [.., +4k)                the escapes' positions in the odd plane, ascending (u32)
    [.., +k)                 the escapes' odd bytes
    zeros up to a multiple of 4096

with k = escapes[i] in the header; the table is the chunk's 15 most frequent odd bytes (most frequent
first; a tie: the smaller byte first). A chunk where more than h/16 odd bytes would be escapes is stored
as its n bytes (escapes[i] = -1). For bf16/fp16 weights the odd byte of each word is the sign and the
top of the exponent, and 15 values cover nearly all of a chunk: it shrinks to ~3/4 (1.33x). The
format is built for the GPU: a load reads each record into pinned memory as it is and the GPU expands
it (TorchEngine.upload_coded), so loading weights costs the CPU nothing but the reads. (Deflating
the odd bytes instead saves more, 1.49x, but inflating 8.8 GB of weights kept the H200 host's 16 cores
busy for 4 s after the process was restored, longer than reading the bytes it saved.) chunk_sha256 and
data_digest are of the data as on the GPU, whatever the encoding, so a file's identity does not depend
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any, Final

from dynamo_snapshot.workload.weights.format import (
    NIBBLE_ESCAPE,
    NIBBLE_TABLE,
    WeightsFileError,
    coded_record_bytes,
    escape_limit,
)

__all__ = [
    "LOOKUP_PIECE",
    "count_escapes",
    "decode_coded",
    "decode_coded_on",
    "encode_coded",
    "encode_coded_on",
    "nibble_table",
    "nibble_table_on",
]

# ---- in plain Python ---------------------------------------------------------------------------------


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


# ---- with torch tensors (on the GPU) -----------------------------------------------------------------

# The lookup from codes to odd bytes runs in pieces of this many: its int32 indices stay small.
LOOKUP_PIECE: Final = 4 << 20


def nibble_table_on(torch: Any, odd: Any) -> tuple[Any, Any]:
    """(table, escapes) of an odd plane (uint8 tensor), as nibble_table and encode_coded make them:
    the 15 most frequent bytes, a tie the smaller first."""
    counts = torch.bincount(odd, minlength=256)
    # Unique keys, so topk's order is the format's: more frequent first, then the smaller byte.
    key = counts * 256 + (255 - torch.arange(256, device=odd.device))
    table = key.topk(NIBBLE_ESCAPE).indices
    return table, odd.numel() - counts[table].sum()


def _lookup(torch: Any, table: Any, codes: Any, out: Any, idx: Any) -> None:
    """out[i] = table[codes[i]], through int32 indices a piece at a time (no big temporaries)."""
    for start in range(0, codes.numel(), LOOKUP_PIECE):
        end = min(start + LOOKUP_PIECE, codes.numel())
        part = idx[: end - start]
        part.copy_(codes[start:end])
        torch.index_select(table, 0, part, out=out[start:end])


def encode_coded_on(torch: Any, planes: Any, rec: Any, codes: Any, idx: Any) -> int:
    """encode_coded with tensors: planes (even | odd of a chunk) -> rec; the record's length."""
    n = int(planes.numel())
    half, quarter = n // 2, n // 4
    even, odd = planes[:half], planes[half:]
    table, escapes = nibble_table_on(torch, odd)
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


def decode_coded_on(torch: Any, rec: Any, n: int, escapes: int, odd: Any, codes: Any, idx: Any) -> None:
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
