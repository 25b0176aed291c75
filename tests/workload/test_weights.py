"""The weights file format and the save/release/load pipeline, with a pure-Python stand-in for the GPU
(fake_cuda: the driver's memory model and a transfer engine over it). What torch and the real driver
do is exercised on the H200 by tests/gpu/vmm_scenarios.py."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import struct
import threading
from pathlib import Path

import pytest

from dynamo_snapshot.fileio import DirectReader
from dynamo_snapshot.workload import weights as w
from dynamo_snapshot.workload.gpu_memory import RegionPool
from dynamo_snapshot.workload.weights import (
    ALIGN,
    ENCODING_RAW,
    ENCODING_SPLIT_NIBBLE,
    ENCODINGS,
    FILE_WEIGHTS_MANIFEST,
    MAGIC,
    PREFIX_BYTES,
    OffloadManifest,
    TensorSpec,
    WeightRegion,
    WeightsFile,
    WeightsFileError,
    WeightsHeader,
    plan_layout,
    read_header,
    read_offload_manifest,
    read_weights_manifest,
    write_weights_manifest,
)
from dynamo_snapshot.workload.weights.format import parse_header
from tests.workload.fake_cuda import FakeDriver, FakeEngine

GRAN = 64 << 10
CHUNK = 64 << 10  # small chunks and blocks so a few hundred KiB exercise every path

TENSORS = [
    ("embed", "bfloat16", (100, 33), 100 * 33 * 2),
    ("odd", "uint8", (1001,), 1001),
    ("empty", "float32", (0, 4), 0),
    ("w1", "float32", (128, 256), 128 * 256 * 4),
    ("scalar", "int64", (), 8),
    ("w2", "float16", (300, 170), 300 * 170 * 2),
]


@pytest.fixture
def cu() -> FakeDriver:
    driver = FakeDriver(granularity=GRAN, total=64 << 20)
    driver.set_current_for_test(FakeDriver.context_of(0))
    return driver


def o_direct_works(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    probe.write_bytes(bytes(ALIGN))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def make_region(
    cu: FakeDriver, tensors: list[tuple[str, str, tuple[int, ...], int]] = TENSORS
) -> WeightRegion:
    region = WeightRegion(driver=cu, engine=FakeEngine, pool=RegionPool())
    region.allocate(tensors)
    return region


def fill_random(cu: FakeDriver, region: WeightRegion, seed: int = 7) -> bytes:
    assert region.region is not None
    data = random.Random(seed).randbytes(region.data_bytes)
    cu.memory(region.region.ptr)[: len(data)] = data
    return data


def fill_weights(cu: FakeDriver, region: WeightRegion, seed: int = 7) -> bytes:
    """Like trained (or freshly initialised) bf16 weights: normal values of small spread, so the
    high byte of each word (sign and exponent) clusters and the low byte (mantissa) does not."""
    assert region.region is not None
    rng = random.Random(seed)
    words = [struct.pack("<f", rng.gauss(0.0, 0.02))[2:] for _ in range(region.data_bytes // 2)]
    data = b"".join(words)
    cu.memory(region.region.ptr)[: len(data)] = data
    return data


def device_bytes(cu: FakeDriver, region: WeightRegion) -> bytes:
    assert region.region is not None
    return bytes(cu.memory(region.region.ptr)[: region.data_bytes])


# ---- layout ---------------------------------------------------------------------------------------


def test_layout_aligns_every_tensor_in_order() -> None:
    specs, end = plan_layout(TENSORS)
    assert [s.name for s in specs] == [t[0] for t in TENSORS]
    assert all(s.offset % 256 == 0 for s in specs)
    assert specs[0].offset == 0
    for prev, cur in itertools.pairwise(specs):
        assert cur.offset == -(-(prev.offset + prev.nbytes) // 256) * 256
    assert end == specs[-1].offset + specs[-1].nbytes
    assert specs[1] == TensorSpec("odd", "uint8", (1001,), 6656, 1001)


def test_layout_with_another_alignment_and_bad_input() -> None:
    specs, end = plan_layout([("a", "uint8", (1,), 1), ("b", "uint8", (1,), 1)], alignment=4096)
    assert [s.offset for s in specs] == [0, 4096]
    assert end == 4097
    with pytest.raises(ValueError, match="power of two"):
        plan_layout([], alignment=384)
    with pytest.raises(ValueError, match="twice"):
        plan_layout([("a", "uint8", (1,), 1), ("a", "uint8", (1,), 1)])
    with pytest.raises(ValueError, match="negative"):
        plan_layout([("a", "uint8", (-1,), 1)])
    assert plan_layout([]) == ([], 0)


# ---- header ---------------------------------------------------------------------------------------


def header_for(data_bytes: int = 3 * CHUNK) -> WeightsHeader:
    specs, _ = plan_layout([("t", "uint8", (data_bytes,), data_bytes)])
    chunks = tuple(hashlib.sha256(bytes([i])).hexdigest() for i in range(-(-data_bytes // CHUNK)))
    return WeightsHeader(tuple(specs), data_bytes, data_bytes + GRAN, CHUNK, chunks, w.data_digest(chunks))


def test_header_encoding_is_aligned_and_self_checking(tmp_path: Path) -> None:
    header = header_for()
    head = header.encode()
    assert len(head) % ALIGN == 0
    magic, version, flags, length, data_offset, data_bytes, digest = struct.unpack_from("<8sIIQQQ32s", head)
    assert (magic, version, flags, data_offset, data_bytes) == (MAGIC, 1, 0, len(head), 3 * CHUNK)
    body = head[PREFIX_BYTES : PREFIX_BYTES + length]
    assert hashlib.sha256(body).digest() == digest
    doc = json.loads(body)
    assert doc["format"] == "dynamo-snapshot-weights"
    assert doc["tensors"] == [
        {"name": "t", "dtype": "uint8", "shape": [3 * CHUNK], "offset": 0, "nbytes": 3 * CHUNK}
    ]
    assert set(head[PREFIX_BYTES + length :]) <= {0}

    path = tmp_path / "f.dsw"
    path.write_bytes(head + bytes(3 * CHUNK))
    assert read_header(path) == (header, len(head))


def coded_header_for() -> WeightsHeader:
    """header_for's layout as a version 2 (split-nibble) file: chunks 0 and 2 coded, 1 stored plain."""
    h = header_for()
    encoding = w.Encoding(ENCODING_SPLIT_NIBBLE, (0, -1, 3))
    return WeightsHeader(
        h.tensors,
        h.data_bytes,
        h.device_bytes,
        h.chunk_bytes,
        h.chunk_sha256,
        h.data_digest,
        encoding=encoding,
    )


@pytest.mark.parametrize(
    ("header", "damage", "message"),
    [
        (header_for, lambda b: b"NOTMAGIC" + b[8:], "not a weights file"),
        (header_for, lambda b: b[:8] + struct.pack("<I", 3) + b[12:], "version 3"),
        (header_for, lambda b: b[: PREFIX_BYTES + 3] + b"X" + b[PREFIX_BYTES + 4 :], "header checksum"),
        (header_for, lambda b: b[:-1], "truncated"),
        (header_for, lambda b: b + b"\0" * ALIGN, "truncated or appended"),
        (header_for, lambda b: b[:100], "too short"),
        # A version 2 file whose prefix says version 1: read as raw, its records would be garbage.
        (coded_header_for, lambda b: b[:8] + struct.pack("<I", 1) + b[12:], "disagree on the version"),
    ],
)
def test_damaged_files_are_refused(tmp_path: Path, header: object, damage: object, message: str) -> None:
    h: WeightsHeader = header()  # type: ignore[operator]
    path = tmp_path / "f.dsw"
    path.write_bytes(h.encode() + bytes(h.stored_bytes))
    assert read_header(path) == (h, len(h.encode()))  # intact, it is read
    path.write_bytes(damage(h.encode() + bytes(h.stored_bytes)))  # type: ignore[operator]
    with pytest.raises(WeightsFileError, match=message):
        read_header(path)


def test_inconsistent_header_contents_are_refused(tmp_path: Path) -> None:
    good = header_for()
    bad_digest = WeightsHeader(
        good.tensors, good.data_bytes, good.device_bytes, CHUNK, good.chunk_sha256, "00" * 32
    )
    moved = (TensorSpec("t", "uint8", (3 * CHUNK,), 256, 3 * CHUNK),)
    bad_layout = WeightsHeader(
        moved, good.data_bytes, good.device_bytes, CHUNK, good.chunk_sha256, good.data_digest
    )
    few_chunks = good.chunk_sha256[:2]
    bad_chunks = WeightsHeader(
        good.tensors, good.data_bytes, good.device_bytes, CHUNK, few_chunks, w.data_digest(few_chunks)
    )
    for header, message in ((bad_digest, "data_digest"), (bad_layout, "layout"), (bad_chunks, "one digest")):
        path = tmp_path / "f.dsw"
        path.write_bytes(header.encode() + bytes(header.data_bytes))
        with pytest.raises(WeightsFileError, match=message):
            read_header(path)


# ---- save / release / load ------------------------------------------------------------------------


def test_save_writes_the_region_in_the_documented_format(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    data = fill_random(cu, region)
    result = region.save(tmp_path / "m.dsw", chunk_bytes=CHUNK, threads=3, encoding=ENCODING_RAW)

    raw = (tmp_path / "m.dsw").read_bytes()
    header, data_offset = read_header(tmp_path / "m.dsw")
    assert result.written
    assert result.bytes == len(raw) == data_offset + region.data_bytes
    assert raw[data_offset:] == data
    assert [p.name for p in tmp_path.iterdir()] == ["m.dsw"]  # nothing beside it: the header is the check
    assert header.tensors == tuple(region.specs)
    assert header.data_bytes == region.data_bytes
    assert region.data_bytes % ALIGN == 0
    assert header.chunk_sha256 == tuple(
        hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)
    )
    assert result.data_digest == header.data_digest
    assert header.encoding is None
    assert raw[8:12] == struct.pack("<I", 1)
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left
    assert all(e.closed for e in FakeEngine.instances)


def decode_split_by_hand(raw: bytes) -> bytes:
    """The data of a split-nibble file, decoded from the module docstring's description alone."""
    _, version, _, header_len, data_offset, stored, _ = struct.unpack_from("<8sIIQQQ32s", raw)
    assert version == 2
    header = json.loads(raw[PREFIX_BYTES : PREFIX_BYTES + header_len])
    enc = header["encoding"]
    assert enc["name"] == "split-nibble"
    out = bytearray()
    at = data_offset
    for i, k in enumerate(enc["escapes"]):
        n = min(header["chunk_bytes"], header["data_bytes"] - i * header["chunk_bytes"])
        if k == -1:
            out += raw[at : at + n]
            at += n
            continue
        h = n // 2
        record = raw[at:]
        odd = bytearray(h)
        for i_odd in range(h):
            byte = record[h + i_odd % (h // 2)]
            odd[i_odd] = byte & 0x0F if i_odd < h // 2 else byte >> 4
        table = record[h + h // 2 : h + h // 2 + 16]
        odd = bytearray(table[c] for c in odd)
        positions = struct.unpack_from(f"<{k}I", record, h + h // 2 + 16)
        for pos, value in zip(
            positions, record[h + h // 2 + 16 + 4 * k : h + h // 2 + 16 + 5 * k], strict=True
        ):
            odd[pos] = value
        chunk = bytearray(n)
        chunk[0::2], chunk[1::2] = record[:h], odd
        out += chunk
        length = h + h // 2 + 16 + 5 * k
        assert set(record[length : -(-length // ALIGN) * ALIGN]) <= {0}
        at += -(-length // ALIGN) * ALIGN
    assert at == data_offset + stored == len(raw)
    return bytes(out)


def test_split_nibble_files_are_smaller_and_in_the_documented_format(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    data = fill_weights(cu, region)
    result = region.save(tmp_path / "m.dsw", chunk_bytes=CHUNK, threads=3)

    raw = (tmp_path / "m.dsw").read_bytes()
    header, data_offset = read_header(tmp_path / "m.dsw")
    assert header.encoding is not None
    assert header.encoding.name == ENCODING_SPLIT_NIBBLE
    assert all(k >= 0 for k in header.encoding.escapes)
    assert sum(header.encoding.escapes) > 0  # the test data has rare values: escapes are exercised
    assert decode_split_by_hand(raw) == data
    # bf16-like data: ~1.33x smaller (less here, where 64 KiB chunks pad their records to 4 KiB)
    assert result.bytes == len(raw) < data_offset + 0.85 * region.data_bytes
    # The data's identity is the same however it is stored.
    raw_result = region.save(tmp_path / "r.dsw", chunk_bytes=CHUNK, encoding=ENCODING_RAW)
    assert raw_result.data_digest == result.data_digest
    assert read_header(tmp_path / "r.dsw")[0].chunk_sha256 == header.chunk_sha256
    with pytest.raises(ValueError, match="encoding"):
        region.save(tmp_path / "x.dsw", encoding="zstd")


def test_chunks_of_many_values_are_stored_plain(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    data = fill_random(cu, region)  # every byte value about equally often: codes would not pay
    region.save(tmp_path / "m.dsw", chunk_bytes=CHUNK)
    header, _ = read_header(tmp_path / "m.dsw")
    assert header.encoding is not None
    assert set(header.encoding.escapes) == {-1}
    assert decode_split_by_hand((tmp_path / "m.dsw").read_bytes()) == data
    region.release()
    region.load(tmp_path / "m.dsw")
    assert device_bytes(cu, region) == data


def test_the_reference_codec_round_trips_and_refuses_what_does_not_fit() -> None:
    rng = random.Random(4)
    few = bytes(rng.choice(b"\x10\x20\x30") for _ in range(4096))
    assert w.decode_coded(w.encode_coded(few) or b"", 4096, 0) == few  # < 15 values: no escapes
    some = bytearray(few)
    for i in rng.sample(range(1, 4096, 2), 40):
        some[i] = 200 + i % 50  # rare odd bytes: escapes
    record = w.encode_coded(some)
    assert record is not None
    escapes = (len(record) - w.coded_record_bytes(4096, 0)) // 5
    assert 0 < escapes <= w.escape_limit(4096)
    assert w.count_escapes(some) == escapes
    assert w.decode_coded(record, 4096, escapes) == bytes(some)
    assert w.encode_coded(rng.randbytes(4096)) is None
    with pytest.raises(ValueError, match="multiple of 4"):
        w.encode_coded(bytes(6))
    bad = bytearray(record)
    struct.pack_into("<I", bad, w.coded_record_bytes(4096, 0), 4096)  # an escape outside the chunk
    with pytest.raises(WeightsFileError, match="outside"):
        w.decode_coded(bad, 4096, escapes)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("direct", [None, True, False])
@pytest.mark.parametrize(
    ("threads", "block", "buffers"), [(16, CHUNK, 4), (3, 2 * ALIGN, 2), (1, 4 * CHUNK, 1)]
)
def test_release_then_load_brings_back_the_same_bytes(
    cu: FakeDriver, tmp_path: Path, direct: bool | None, threads: int, block: int, buffers: int, encoding: str
) -> None:
    region = make_region(cu)
    assert region.region is not None
    ptr = region.region.ptr
    data = fill_weights(cu, region)
    region.save(tmp_path / "m.dsw", chunk_bytes=CHUNK, encoding=encoding)

    assert region.release() == region.region.size
    assert region.released
    assert cu.used == 0
    result = region.load(tmp_path / "m.dsw", threads=threads, block=block, buffers=buffers, direct=direct)

    assert region.region.ptr == ptr
    assert device_bytes(cu, region) == data
    assert result.bytes == region.data_bytes
    assert result.seconds > 0
    assert result.gbps > 0
    assert result.block == (block if encoding == ENCODING_RAW else CHUNK)  # coded files: chunk by chunk
    assert result.extra["encoding"] == encoding
    _, data_offset = read_header(tmp_path / "m.dsw")
    assert result.extra["stored_bytes"] == (tmp_path / "m.dsw").stat().st_size - data_offset
    assert result.threads == threads
    assert not result.verified
    if direct is False:
        assert not result.direct
    if direct is True and o_direct_works(tmp_path):
        assert result.direct  # the ring's buffers are page-aligned, every piece a multiple of ALIGN
    assert 0.0 <= (result.resident_fraction or 0.0) <= 1.0
    json.dumps(result.to_dict())
    assert all(e.closed for e in FakeEngine.instances)
    assert cu.registered == {}  # no pinned host memory left behind


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_verified_load_checks_every_chunk(cu: FakeDriver, tmp_path: Path, encoding: str) -> None:
    region = make_region(cu)
    data = fill_weights(cu, region)
    path = tmp_path / "m.dsw"
    region.save(path, chunk_bytes=CHUNK, encoding=encoding)
    region.release()
    result = region.load(path, block=4 * CHUNK, verify=True)
    assert result.verified
    assert result.block == CHUNK  # verification reads chunk by chunk
    assert device_bytes(cu, region) == data

    # One flipped byte in the data (of chunk 1's even plane, for a coded file): the header is intact,
    # so only verification can see it.
    header, data_offset = read_header(path)
    with open(path, "r+b") as f:
        f.seek(data_offset + header.records()[1].offset + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    region.release()
    with pytest.raises(WeightsFileError, match="chunk 1 "):
        region.load(path, verify=True)
    region.release()
    region.load(path)  # without verification the damage goes unnoticed (the agent verifies files)
    assert device_bytes(cu, region) != data


def test_a_damaged_record_is_caught_by_verification(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    data = fill_weights(cu, region)
    path = tmp_path / "m.dsw"
    region.save(path, chunk_bytes=CHUNK)
    header, data_offset = read_header(path)
    rec = header.records()[2]
    with open(path, "r+b") as f:
        f.seek(data_offset + rec.offset + rec.nbytes // 2 + 5)  # a byte of codes
        f.write(b"\xff")
    region.release()
    with pytest.raises(WeightsFileError, match="chunk 2 "):
        region.load(path, verify=True)
    region.release()
    region.load(path)
    assert device_bytes(cu, region) != data  # unnoticed without verification (the agent checks files)
    assert all(e.closed for e in FakeEngine.instances)


def test_inconsistent_encodings_are_refused(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    fill_weights(cu, region)
    path = tmp_path / "m.dsw"
    region.save(path, chunk_bytes=CHUNK)
    header, _ = read_header(path)
    assert header.encoding is not None
    escapes = header.encoding.escapes

    def rewrite(**change: object) -> None:
        enc = {**header.encoding.to_json(), **change}  # type: ignore[union-attr]
        bad = w.WeightsHeader(**{**header.__dict__, "encoding": None})
        body = {**bad.to_json(), "version": 2, "encoding": enc}
        with pytest.raises(WeightsFileError, match=r"encoding|escape"):
            parse_header(json.dumps(body).encode())

    rewrite(name="zstd")
    rewrite(escapes=list(escapes[:-1]))  # a chunk without a count
    rewrite(escapes=[-2, *escapes[1:]])
    rewrite(escapes=[CHUNK, *escapes[1:]])  # more escapes than a coded chunk may have
    rewrite(escapes="many")
    v1 = {**header.to_json(), "version": 1}
    with pytest.raises(WeightsFileError, match="version 1"):
        parse_header(json.dumps(v1).encode())


def test_save_skips_an_identical_file_and_rewrites_a_different_one(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    fill_random(cu, region, seed=1)
    path = tmp_path / "m.dsw"
    first = region.save(path, chunk_bytes=CHUNK)
    stat = path.stat()

    again = region.save(path, chunk_bytes=CHUNK)
    assert not again.written
    assert (again.data_digest, again.bytes) == (first.data_digest, first.bytes)
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert path.stat().st_ino == stat.st_ino

    fill_random(cu, region, seed=2)
    changed = region.save(path, chunk_bytes=CHUNK)
    assert changed.written
    assert changed.data_digest != first.data_digest
    assert read_header(path)[0].data_digest == changed.data_digest

    other_chunks = region.save(path, chunk_bytes=2 * CHUNK)  # another layout of digests: rewritten
    assert other_chunks.written


def test_load_refuses_a_file_of_another_layout(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    fill_random(cu, region)
    region.save(tmp_path / "m.dsw")
    other = make_region(cu, [*TENSORS[:-1], ("w2", "float16", (300, 171), 300 * 171 * 2)])
    with pytest.raises(WeightsFileError, match="layout"):
        other.load(tmp_path / "m.dsw")


def test_a_new_region_takes_the_files_layout(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    data = fill_random(cu, region)
    region.save(tmp_path / "m.dsw")
    fresh = WeightRegion(driver=cu, engine=FakeEngine, pool=RegionPool())
    fresh.load(tmp_path / "m.dsw", threads=4)
    assert fresh.specs == region.specs
    assert device_bytes(cu, fresh) == data


def test_save_needs_a_mapped_region(cu: FakeDriver, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pack"):
        WeightRegion(driver=cu, engine=FakeEngine).save(tmp_path / "x")
    region = make_region(cu)
    region.release()
    with pytest.raises(RuntimeError, match="released"):
        region.save(tmp_path / "x")


def test_a_failed_read_closes_everything_and_leaves_the_region_mapped(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    fill_random(cu, region)
    path = tmp_path / "m.dsw"
    region.save(path, chunk_bytes=CHUNK)
    region.release()

    real_read = DirectReader.read
    calls = 0

    def failing_read(self: DirectReader, view: memoryview, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(5, "Input/output error")
        return real_read(self, view, offset)

    DirectReader.read = failing_read  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="Input/output"):
            region.load(path, threads=2, block=2 * ALIGN)
    finally:
        DirectReader.read = real_read  # type: ignore[method-assign]
    assert all(e.closed for e in FakeEngine.instances)
    assert region.region is not None
    assert region.region.mapped
    assert cu.registered == {}


def test_reader_falls_back_to_buffered_reads_when_o_direct_refuses(tmp_path: Path) -> None:
    path = tmp_path / "f"
    payload = random.Random(3).randbytes(3 * ALIGN)
    path.write_bytes(payload)
    buf = w.MmapBuffer(3 * ALIGN)
    reader = DirectReader(path, direct=True)
    try:
        # An unaligned piece: O_DIRECT answers EINVAL (where the filesystem has O_DIRECT at all).
        assert reader.read(buf.view()[1 : 1 + ALIGN], 1) == ALIGN
        assert bytes(buf.view()[1 : 1 + ALIGN]) == payload[1 : 1 + ALIGN]
        assert reader.read(buf.view()[: 2 * ALIGN], 2 * ALIGN) == ALIGN  # short only at end of file
        assert not reader.direct
    finally:
        reader.close()
        buf.close()


# ---- manifest and page cache ----------------------------------------------------------------------


def test_weights_manifest_round_trip(tmp_path: Path) -> None:
    assert read_weights_manifest(tmp_path) == []
    assert read_offload_manifest(tmp_path) is None
    files = [WeightsFile("/models/a.dsw", 4096 * 3, "cd" * 32, 0)]
    path = write_weights_manifest(tmp_path, files, {0: 2 << 30})
    assert path == tmp_path / FILE_WEIGHTS_MANIFEST == tmp_path / "weights.json"
    doc = json.loads(path.read_text())
    assert doc == {
        "version": 3,
        "files": [
            {
                "path": "/models/a.dsw",
                "bytes": 12288,
                "data_digest": "cd" * 32,
                "device": 0,
            }
        ],
        "released_bytes": {"0": 2 << 30},
        "waits_for_weights_check": False,
        "reads_arriving_weights": False,
    }
    assert read_weights_manifest(tmp_path) == files
    assert read_offload_manifest(tmp_path) == OffloadManifest(files, {0: 2 << 30})
    # Versions 1 (no released_bytes) and 2 still read; the whole-file sha256 they list is read past.
    older = [{**doc["files"][0], "sha256": "ab" * 32}]
    path.write_text(json.dumps({"version": 1, "files": older}))
    assert read_offload_manifest(tmp_path) == OffloadManifest(files, {})
    path.write_text(json.dumps({"version": 2, "files": older, "released_bytes": {"0": 7}}))
    assert read_offload_manifest(tmp_path) == OffloadManifest(files, {0: 7})
    # Written by an SDK that waits for the agent's verdict on the weights; absent means it does not.
    w.write_weights_manifest(tmp_path, files, {0: 1}, waits_for_weights_check=True)
    assert read_offload_manifest(tmp_path) == OffloadManifest(files, {0: 1}, waits_for_weights_check=True)
    # And reads each byte of a file still arriving only once the agent says it is in.
    w.write_weights_manifest(
        tmp_path, files, {0: 1}, waits_for_weights_check=True, reads_arriving_weights=True
    )
    assert read_offload_manifest(tmp_path) == OffloadManifest(
        files, {0: 1}, True, reads_arriving_weights=True
    )
    path.write_text('{"version": 3, "files": [], "reads_arriving_weights": 1}')
    with pytest.raises(ValueError, match="reads_arriving_weights must be true or false"):
        read_offload_manifest(tmp_path)
    path.write_text('{"version": 2, "files": [], "waits_for_weights_check": "yes"}')
    with pytest.raises(ValueError, match="waits_for_weights_check must be true or false"):
        read_offload_manifest(tmp_path)
    path.write_text('{"version": 2, "files": [], "released_bytes": {"0": -1}}')
    with pytest.raises(ValueError, match="negative released_bytes"):
        read_offload_manifest(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_offload_manifest(tmp_path)
    path.write_text('{"version": 9, "files": []}')
    with pytest.raises(ValueError, match="version 3"):
        read_weights_manifest(tmp_path)
    path.write_text('{"version": 1, "files": [{"path": "/x"}]}')
    with pytest.raises(ValueError, match="bad entry"):
        read_weights_manifest(tmp_path)


def test_waiting_for_the_weights_verdict(tmp_path: Path) -> None:
    assert w.weights_check_pending({"weightsCheck": "pending", "podName": "p"})
    assert not w.weights_check_pending({"podName": "p"})
    assert not w.weights_check_pending("pending")
    assert not w.weights_check_pending(None)
    with pytest.raises(TimeoutError, match="did not confirm the weights"):
        w.wait_for_weights_verified(tmp_path, timeout=0.05)
    threading.Timer(0.2, (tmp_path / "weights-verified").write_text, args=("{}",)).start()
    assert 0.1 < w.wait_for_weights_verified(tmp_path, timeout=10) < 10


def test_warm_page_cache_reads_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 * ALIGN + 7))
    result = w.warm_page_cache(path, threads=3, block=2 * ALIGN)
    assert result.bytes == 5 * ALIGN + 7
    fraction = w.page_cache_fraction(path)
    assert fraction is None or fraction == pytest.approx(1.0)
    assert w.page_cache_fraction(tmp_path / "absent") is None


def test_warm_weights_from_the_control_dir(cu: FakeDriver, tmp_path: Path) -> None:
    region = make_region(cu)
    fill_random(cu, region)
    saved = region.save(tmp_path / "m.dsw")
    write_weights_manifest(tmp_path, [saved.manifest_entry(0), WeightsFile("/absent", 1, "0", 0)])
    (warm,) = w.warm_weights(tmp_path, threads=2)
    assert warm.bytes == saved.bytes
