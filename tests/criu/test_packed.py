"""The packed pages format: what goes in comes out byte for byte (compressible, incompressible, empty,
sizes that are no multiple of a chunk), a damaged or truncated file is refused rather than unpacked
short, and a stop leaves no partial output. The images-directory steps (pack_pages, stage_images) on
synthetic dumps; tests/agent/test_packed_pages.py has them with real CRIU."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest

from dynamo_snapshot.criu import packed
from dynamo_snapshot.criu.packed import (
    PACKED_SUFFIX,
    PackedFormatError,
    Stopped,
    is_packed_pages,
    pack_file,
    pack_pages,
    stage_images,
    staged_bytes,
    unpack_file,
    unpacked_size,
)
from tests.helpers.polling import cancel_and_settle

CHUNK = 64 << 10  # small chunks: many of them in little data
TEXT = b"".join(b"%08d the quick brown fox jumps over the lazy dog\n" % i for i in range(20000))


def _mixed(size: int) -> bytes:
    """Zeros, text and random bytes in runs that do not line up with chunks."""
    parts, n, i = [], 0, 0
    while n < size:
        run = min(size - n, 37_000 + 11_000 * (i % 5))
        kind = i % 3
        parts.append(bytes(run) if kind == 0 else TEXT[:run] if kind == 1 else os.urandom(run))
        n, i = n + run, i + 1
    return b"".join(parts)


def _roundtrip(tmp: Path, data: bytes, **kwargs: int) -> tuple[packed.PackStats, bytes]:
    src, dst, out = tmp / "src", tmp / "src.dsz", tmp / "out"
    src.write_bytes(data)
    stats = pack_file(src, dst, chunk_bytes=CHUNK, **kwargs)
    assert stats.packed == dst.stat().st_size
    assert unpacked_size(dst) == len(data)
    assert unpack_file(dst, out, threads=3) == len(data)
    return stats, out.read_bytes()


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 4095, 3 << 20])
def test_roundtrip_of_mixed_data_of_any_size(tmp_path: Path, size: int) -> None:
    data = _mixed(size)
    stats, out = _roundtrip(tmp_path, data, threads=4)
    assert out == data
    assert stats.chunks == -(-size // CHUNK)
    if size >= 3 << 20:
        assert stats.packed < size * 0.8  # a third zeros, a third text
        assert 0 < stats.raw_chunks < stats.chunks  # the random runs' chunks do not shrink


def test_incompressible_data_is_stored_raw_and_comes_back(tmp_path: Path) -> None:
    data = os.urandom(10 * CHUNK + 123)
    stats, out = _roundtrip(tmp_path, data, threads=2)
    assert out == data
    assert stats.raw_chunks == stats.chunks == 11
    # The raw chunks themselves, and only the header and index besides.
    assert stats.packed == len(data) + 32 + 16 * 11


def test_chunks_are_independent_raw_deflate_streams(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = TEXT[: 3 * CHUNK]
    src.write_bytes(data)
    pack_file(src, dst, chunk_bytes=CHUNK, threads=1)
    raw = dst.read_bytes()
    magic, version, chunk, size, count = struct.unpack_from("<8sIIQQ", raw)
    assert (magic, version, chunk, size, count) == (b"DSZPAGES", 1, CHUNK, len(data), 3)
    for i in range(count):
        offset, stored, kind = struct.unpack_from("<QII", raw, 32 + 16 * i)
        assert kind == 1
        assert zlib.decompress(raw[offset : offset + stored], -15) == data[i * CHUNK : (i + 1) * CHUNK]


def test_a_packed_file_written_by_one_thread_or_many_is_the_same(tmp_path: Path) -> None:
    data = _mixed(2 << 20)
    (tmp_path / "src").write_bytes(data)
    pack_file(tmp_path / "src", tmp_path / "one", chunk_bytes=CHUNK, threads=1)
    pack_file(tmp_path / "src", tmp_path / "many", chunk_bytes=CHUNK, threads=8)
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()


def _packed(tmp: Path, data: bytes) -> Path:
    src, dst = tmp / "src", tmp / "pages-1.img.dsz"
    src.write_bytes(data)
    pack_file(src, dst, chunk_bytes=CHUNK, threads=2)
    return dst


def _unpack_fails(tmp: Path, packed_file: Path, match: str) -> None:
    out = tmp / "out"
    with pytest.raises(PackedFormatError, match=match):
        unpack_file(packed_file, out, threads=2)
    assert not out.exists(), "a refused file leaves no partial output"


def test_truncated_or_extended_files_are_refused(tmp_path: Path) -> None:
    data = TEXT[: 5 * CHUNK]
    dst = _packed(tmp_path, data)
    whole = dst.read_bytes()
    for cut, match in [
        (len(whole) - 1, "truncated"),
        (len(whole) // 2, "truncated"),
        (40, r"truncated \(index"),
        (20, "no complete header"),
        (0, "no complete header"),
    ]:
        dst.write_bytes(whole[:cut])
        _unpack_fails(tmp_path, dst, match)
    dst.write_bytes(whole + b"\0")
    _unpack_fails(tmp_path, dst, "trailing bytes")


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    data = TEXT[: 5 * CHUNK]
    dst = _packed(tmp_path, data)
    whole = bytearray(dst.read_bytes())

    def damaged(pos: int, value: bytes) -> Path:
        bad = bytearray(whole)
        bad[pos : pos + len(value)] = value
        dst.write_bytes(bytes(bad))
        return dst

    _unpack_fails(tmp_path, damaged(0, b"NOTPAGES"), "not a packed pages file")
    _unpack_fails(tmp_path, damaged(8, struct.pack("<I", 2)), "format version 2")
    _unpack_fails(tmp_path, damaged(24, struct.pack("<Q", 4)), "cannot hold")  # chunk count
    _unpack_fails(tmp_path, damaged(16, struct.pack("<Q", len(data) + 1)), "cannot hold")  # size
    first_kind = 32 + 12
    _unpack_fails(tmp_path, damaged(first_kind, struct.pack("<I", 7)), "unknown kind 7")
    # A compressed chunk claimed raw: its stored length is not the chunk's.
    _unpack_fails(tmp_path, damaged(first_kind, struct.pack("<I", 0)), "raw chunk 0")
    # Garbled deflate data (lengths all as they were).
    offset, stored, _ = struct.unpack_from("<QII", whole, 32 + 16)
    _unpack_fails(tmp_path, damaged(offset + stored // 2, b"\xff" * 16), "chunk 1")


def test_a_chunk_that_inflates_to_the_wrong_length_is_refused(tmp_path: Path) -> None:
    # Well-formed streams, all lengths consistent, but one decodes to a byte too few or too many.
    data = TEXT[: 2 * CHUNK]
    dst = _packed(tmp_path, data)
    whole = dst.read_bytes()
    off0, stored0, _ = struct.unpack_from("<QII", whole, 32)
    for plain, match in [(data[: CHUNK - 1], "decodes to 65535 bytes"), (data[: CHUNK + 1], "chunk 0")]:
        z = zlib.compressobj(1, zlib.DEFLATED, -15)
        stream = z.compress(plain) + z.flush()
        rest = whole[off0 + stored0 :]
        index = struct.pack("<QII", off0, len(stream), 1) + struct.pack(
            "<QII", off0 + len(stream), struct.unpack_from("<QII", whole, 48)[1], 1
        )
        dst.write_bytes(whole[:32] + index + stream + rest)
        _unpack_fails(tmp_path, dst, match)


def test_a_stop_removes_the_partial_output(tmp_path: Path) -> None:
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    src.write_bytes(_mixed(2 << 20))
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        pack_file(src, dst, chunk_bytes=CHUNK, stop=stop)
    assert not dst.exists()
    pack_file(src, dst, chunk_bytes=CHUNK)
    with pytest.raises(Stopped):
        unpack_file(dst, out, stop=stop)
    assert not out.exists()
    with pytest.raises(FileExistsError):  # never overwrites
        pack_file(src, dst, chunk_bytes=CHUNK)


class Gate:
    """packed._deflate, held at its ``at``-th call until released: a stop or cancel then lands while the
    work is surely midway, whatever the machine's speed, and ``calls`` tells how far it went on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.calls, self.at = 0, at
        self.reached, self.release = threading.Event(), threading.Event()
        real = packed._deflate

        def deflate(fd: int, start: int, length: int) -> tuple[bytes, int]:
            self.calls += 1  # one thread: no race
            if self.calls == self.at:
                self.reached.set()
                assert self.release.wait(10), "never released"
            return real(fd, start, length)

        monkeypatch.setattr(packed, "_deflate", deflate)


def test_a_stop_set_midway_stops_within_a_few_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(_mixed(64 * CHUNK))
    gate, stop = Gate(monkeypatch, at=4), threading.Event()

    def stop_midway() -> None:
        gate.reached.wait(10)
        stop.set()
        gate.release.set()

    threading.Thread(target=stop_midway).start()
    with pytest.raises(Stopped):
        pack_file(src, dst, chunk_bytes=CHUNK, threads=1, stop=stop)
    # One thread keeps two chunks in flight: at most those after the stop, not the other 60.
    assert gate.calls <= gate.at + 2, gate.calls
    assert not dst.exists()


# ---- images directories --------------------------------------------------------------------------------


def _images(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    images = tmp / "images"
    (images / "sub").mkdir(parents=True)
    files = {
        "pages-1.img": _mixed(3 << 20),  # packed
        "pages-2.img": TEXT[:100_000],  # too small: stays plain
        "pages-3.img": os.urandom(2 << 20),  # incompressible: stays plain
        "pagemap-1.img": b"pagemap",
        "inventory.img": b"inventory",
        "sub/x.img": b"x",
    }
    for rel, data in files.items():
        (images / rel).write_bytes(data)
    return images, files


def test_pack_pages_packs_the_big_compressible_pages_images_only(tmp_path: Path) -> None:
    images, files = _images(tmp_path)
    done = pack_pages(images, threads=2)
    assert (done.files, done.kept, done.failed) == (1, 1, {})
    assert done.bytes_before == len(files["pages-1.img"])
    assert done.bytes_after == (images / "pages-1.img.dsz").stat().st_size < done.bytes_before
    assert sorted(p.name for p in images.iterdir()) == [
        "inventory.img",
        "pagemap-1.img",
        "pages-1.img.dsz",
        "pages-2.img",
        "pages-3.img",
        "sub",
    ]
    assert pack_pages(images).files == 0  # done once, nothing left to pack
    assert is_packed_pages("criu/pages-1.img" + PACKED_SUFFIX)
    assert not is_packed_pages("criu/pages-1.img")
    assert not is_packed_pages("criu/pagemap-1.img" + PACKED_SUFFIX)


def test_pack_pages_stopped_leaves_each_image_plain_or_packed(tmp_path: Path) -> None:
    images, _ = _images(tmp_path)
    before = sorted(p.name for p in images.iterdir())
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        pack_pages(images, stop=stop)
    assert sorted(p.name for p in images.iterdir()) == before


def test_stage_images_unpacks_and_copies_only_the_files_named(tmp_path: Path) -> None:
    images, files = _images(tmp_path)
    pack_pages(images, threads=2)
    (images / "unsealed.img").write_bytes(b"not in the list")
    rels = [p.relative_to(images).as_posix() for p in images.rglob("*") if p.is_file()]
    rels.remove("unsealed.img")
    dest = tmp_path / "staged"
    dest.mkdir()
    assert staged_bytes(images, rels) == sum(len(d) for d in files.values())
    stats = stage_images(images, rels, dest, threads=3)
    assert (stats.files, stats.copied) == (1, 5)
    assert stats.bytes == len(files["pages-1.img"])
    staged = {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file()}
    assert sorted(staged) == sorted(files)
    for rel, data in files.items():
        assert not staged[rel].is_symlink()
        assert staged[rel].read_bytes() == data, rel


def test_stage_images_refuses_ambiguous_or_escaping_names(tmp_path: Path) -> None:
    images, _ = _images(tmp_path)
    pack_pages(images, threads=2)
    (images / "pages-1.img").write_bytes(b"a plain one as well")
    dest = tmp_path / "staged"
    dest.mkdir()
    with pytest.raises(PackedFormatError, match="both a plain and a packed"):
        stage_images(images, ["pages-1.img", "pages-1.img.dsz"], dest)
    with pytest.raises(ValueError, match="not a relative path"):
        stage_images(images, ["../images/inventory.img"], dest)
    assert list(dest.iterdir()) == []


async def test_a_cancelled_checkpoint_waits_for_the_compression_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo_snapshot.agent.page_images import compress_pages as _compress_pages

    (tmp_path / "pages-1.img").write_bytes(TEXT[: 1 << 20] * 48)  # 12 chunks of 4 MiB
    gate = Gate(monkeypatch, at=2)
    task = asyncio.create_task(_compress_pages(tmp_path, 1))
    assert await asyncio.to_thread(gate.reached.wait, 10)
    # The gate opens once the cancel is in: the compression thread is then told to stop.
    asyncio.get_running_loop().call_soon(gate.release.set)
    # Nothing writes in the directory any more, and its pages image is whole and plain.
    assert await cancel_and_settle(task, tmp_path) == ["pages-1.img"]
    assert gate.calls < 12, "compressed to the end despite the cancel"
    assert (tmp_path / "pages-1.img").stat().st_size == 48 << 20
