"""Zero pages dropped from a real CRIU dump come back as zeros, and only where that is so: anonymous
memory yes, also a forked child's zeroed copy-on-write page, which CRIU would otherwise restore from the
parent's; a private file mapping's zeroed page no (a missing page there shows the file's bytes)."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu, sparse
from dynamo_snapshot.criu.sparse import PAGE, ImageFormatError, drop_zero_pages
from tests.helpers.polling import cancel_and_settle, wait_file
from tests.helpers.script_process import kill_groups, smaps_field, start_script

# Root: 512 anonymous pages, even ones random, odd ones written with zeros, and 256 more never touched;
# 600 pages written with zeros;
# a private mapping of a file of non-zero bytes with its second page overwritten by zeros. Child
# (forked after the parent filled a 64-page anonymous region with non-zero bytes): zeros over its
# first page, a copy-on-write page its parent still holds non-zero. Each writes the SHA-256 of what
# it holds before the dump and again after the restore.
WORKER = r"""
import hashlib, mmap, os, sys, time
d, P = sys.argv[1], mmap.PAGESIZE
anon = mmap.mmap(-1, 768 * P, flags=mmap.MAP_PRIVATE)  # mmap's default is shared
for i in range(512):
    anon[i * P:(i + 1) * P] = os.urandom(P) if i % 2 == 0 else bytes(P)
path = os.path.join(d, "file")
with open(path, "wb") as f:
    f.write(b"\xab" * (4 * P))
fd = os.open(path, os.O_RDWR)
private = mmap.mmap(fd, 4 * P, flags=mmap.MAP_PRIVATE)
private[P:2 * P] = bytes(P)
zeros = mmap.mmap(-1, 600 * P, flags=mmap.MAP_PRIVATE)
zeros[:] = bytes(600 * P)  # written, so dumped: whole batches of zero pages
inherited = mmap.mmap(-1, 64 * P, flags=mmap.MAP_PRIVATE)
inherited[:] = b"\xcd" * (64 * P)

def digest(*maps):
    h = hashlib.sha256()
    for m in maps:
        h.update(m[:])
    return h.hexdigest()

def report(name, text):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))

if os.fork() == 0:
    inherited[:P] = bytes(P)
    role, maps = "child", (inherited,)
else:
    role, maps = "parent", (anon, private, inherited, zeros)
report("before-" + role, digest(*maps))
report("pid-" + role, str(os.getpid()))
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
report("after-" + role, digest(*maps))
while True:
    time.sleep(1)
"""


def _pages_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


@pytest.mark.criu
async def test_dropped_zero_pages_restore_as_zeros_and_only_where_safe(
    criu_bin: Path, tmp_path: Path
) -> None:
    work, images = tmp_path / "work", tmp_path / "images"
    proc = await start_script(WORKER, work)
    restored_pid = None
    try:
        before = {
            role: await asyncio.to_thread(wait_file, work / f"before-{role}") for role in ("parent", "child")
        }
        criu = Criu(criu_bin)
        child = int(await asyncio.to_thread(wait_file, work / "pid-child"))
        await criu.dump(proc.pid, images)
        await proc.wait()
        # The child was ours only through the worker: whoever inherited it reaps it, soon.
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(os.path.exists, f"/proc/{child}"):
            assert time.monotonic() < deadline, "the dumped child never went away"
            await asyncio.sleep(0.02)
        size_before = _pages_bytes(images)

        stats = await asyncio.to_thread(drop_zero_pages, images)
        assert stats.skipped == {}
        # The root's 256 zero-written pages at least (Python's own heap has some more), never the
        # untouched ones, which CRIU does not dump, nor the private file page; the child's one.
        assert stats.pages_dropped >= 256 + 600 + 1
        assert _pages_bytes(images) == size_before - stats.bytes_dropped
        assert stats.processes[proc.pid] >= 256 + 600
        assert stats.processes[child] >= 1
        # Done once, there is nothing left to drop.
        assert drop_zero_pages(images).pages_dropped == 0

        restored = await criu.restore(images, log_dir=tmp_path / "logs")
        restored_pid = restored.pid
        (work / "go").touch()
        for role in ("parent", "child"):
            assert await asyncio.to_thread(wait_file, work / f"after-{role}") == before[role], role
    finally:
        kill_groups(proc.pid, restored_pid)


def test_unreadable_images_are_refused_or_left_alone(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        drop_zero_pages(tmp_path)
    (tmp_path / "pstree.img").write_bytes(b"not an image")
    with pytest.raises(ImageFormatError, match="magic"):
        drop_zero_pages(tmp_path)
    # A process whose mm image is missing keeps its images as they are.
    pstree_entry = bytes([0x08, 42, 0x10, 0])  # pid 42, ppid 0
    (tmp_path / "pstree.img").write_bytes(
        struct.pack("<II", 0x54564319, 0x50273030) + struct.pack("<I", len(pstree_entry)) + pstree_entry
    )
    pages = tmp_path / "pages-1.img"
    pages.write_bytes(bytes(PAGE))
    stats = drop_zero_pages(tmp_path)
    assert stats.pages_dropped == 0
    assert "mm-42.img" in stats.skipped[42]
    assert pages.read_bytes() == bytes(PAGE)


# ---- synthetic dumps: the rewrite itself, without CRIU --------------------------------------------


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    out = bytearray()
    for number, value in fields:
        if isinstance(value, bytes):
            out.append(number << 3 | 2)
            sparse._put_varint(out, len(value))
            out += value
        else:
            out.append(number << 3)
            sparse._put_varint(out, value)
    return bytes(out)


def _image(path: Path, magic: int, entries: list[bytes]) -> None:
    sparse._write_entries(path, magic, entries)


def _dump(tmp: Path, pages: list[bytes], *, status: int = 1 << 9 | 1, vaddr: int = 0x10000) -> Path:
    """One process (pid 7), one VMA of `status` holding `pages` in one pagemap entry."""
    _image(tmp / "pstree.img", sparse._PSTREE_MAGIC, [_msg((1, 7), (2, 0))])
    vma = _msg((1, vaddr), (2, vaddr + len(pages) * PAGE), (7, status))
    _image(tmp / "mm-7.img", sparse._MM_MAGIC, [_msg((14, vma))])
    entry = _msg((1, vaddr), (2, len(pages)), (4, 6))  # present | lazy, as CRIU writes anonymous pages
    _image(tmp / "pagemap-7.img", sparse._PAGEMAP_MAGIC, [_msg((1, 3)), entry])
    (tmp / "pages-3.img").write_bytes(b"".join(pages))
    return tmp


def _pagemap(tmp: Path) -> tuple[int, list[tuple[int, int, int]]]:
    head, *entries = sparse._read_entries(tmp / "pagemap-7.img", sparse._PAGEMAP_MAGIC)
    return sparse._ints(head)[1], [(e[1], e[2], e[4]) for e in map(sparse._ints, entries)]


def test_a_rewrite_splits_entries_around_zero_pages_and_compacts_the_pages_in_place(tmp_path: Path) -> None:
    a, b, zero = b"a" * PAGE, b"b" * PAGE, bytes(PAGE)
    _dump(tmp_path, [a, zero, zero, b, zero])
    inode = (tmp_path / "pages-3.img").stat().st_ino
    stats = drop_zero_pages(tmp_path)
    assert (stats.pages_before, stats.pages_dropped) == (5, 3)
    pages_id, entries = _pagemap(tmp_path)
    assert pages_id == 3
    assert entries == [(0x10000, 1, 6), (0x10000 + 3 * PAGE, 1, 6)]
    assert (tmp_path / "pages-3.img").read_bytes() == a + b
    assert (tmp_path / "pages-3.img").stat().st_ino == inode  # the same file, its pages moved, cut short
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mm-7.img",
        "pagemap-7.img",
        "pages-3.img",
        "pstree.img",
    ]


def test_a_process_of_zero_pages_only_keeps_its_images(tmp_path: Path) -> None:
    # CRIU's restore crashes on a pagemap without entries.
    _dump(tmp_path, [bytes(PAGE)] * 3)
    stats = drop_zero_pages(tmp_path)
    assert stats.pages_dropped == 0
    assert _pagemap(tmp_path) == (3, [(0x10000, 3, 6)])
    assert (tmp_path / "pages-3.img").read_bytes() == bytes(3 * PAGE)


def test_file_backed_pages_and_a_stop_leave_the_images_as_they_were(tmp_path: Path) -> None:
    private_file = 1 << 6 | 1
    (tmp_path / "file").mkdir()
    _dump(tmp_path / "file", [bytes(PAGE)] * 2 + [b"x" * PAGE], status=private_file)
    assert drop_zero_pages(tmp_path / "file").pages_dropped == 0
    assert _pagemap(tmp_path / "file") == (3, [(0x10000, 3, 6)])

    (tmp_path / "stop").mkdir()
    _dump(tmp_path / "stop", [b"y" * PAGE, bytes(PAGE)])
    stop = threading.Event()
    stop.set()
    with pytest.raises(sparse.Stopped):
        drop_zero_pages(tmp_path / "stop", stop)
    assert _pagemap(tmp_path / "stop") == (3, [(0x10000, 2, 6)])
    assert sorted(p.name for p in (tmp_path / "stop").iterdir()) == [
        "mm-7.img",
        "pagemap-7.img",
        "pages-3.img",
        "pstree.img",
    ]


async def test_a_cancelled_checkpoint_waits_for_the_rewrite_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo_snapshot.agent.page_images import drop_zero_pages_of as _drop_zero_pages

    # 64 MiB of alternating pages: the page-by-page path, each kept page written a little later than it
    # would be, so that the rewrite is still moving pages when the cancel comes however fast the machine.
    pages = [(b"z" * PAGE if i % 2 else bytes(PAGE)) for i in range((64 << 20) // PAGE)]
    _dump(tmp_path, pages)
    keep = sparse._Compactor.keep

    def slow_keep(self: sparse._Compactor, view: memoryview, at: int, in_place: int | None = None) -> None:
        time.sleep(0.0002)
        keep(self, view, at, in_place)

    monkeypatch.setattr(sparse._Compactor, "keep", slow_keep)
    task = asyncio.create_task(_drop_zero_pages(tmp_path))
    await asyncio.sleep(0.02)
    # Nothing writes in the directory any more (the caller throws the dump away now): no file comes or
    # goes, and the pages moved so far stay where they are; the pagemap was not switched.
    left = await cancel_and_settle(task, tmp_path)
    assert left == ["mm-7.img", "pagemap-7.img", "pages-3.img", "pstree.img"]
    moved = (tmp_path / "pages-3.img").read_bytes()
    assert moved != b"".join(pages), "cancelled before any page moved: give it more work"
    await asyncio.sleep(0.3)
    assert (tmp_path / "pages-3.img").read_bytes() == moved
    assert _pagemap(tmp_path) == (3, [(0x10000, len(pages), 6)])


async def test_a_write_failing_mid_rewrite_fails_the_checkpoint_not_just_the_drop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo_snapshot.agent.errors import AgentError
    from dynamo_snapshot.agent.page_images import drop_zero_pages_of as _drop_zero_pages

    # A failed read of the images keeps them as CRIU wrote them (the drop is skipped); once pages have
    # moved, the images no longer match their pagemap, and publishing them would publish a corrupt dump.
    _dump(tmp_path, [b"a" * PAGE, bytes(PAGE), b"b" * PAGE, b"c" * PAGE])

    def failing_pwrite(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sparse.os, "pwrite", failing_pwrite)
    with pytest.raises(sparse.Damaged, match=r"pages-3\.img: .*Input/output error"):
        drop_zero_pages(tmp_path)
    with pytest.raises(AgentError, match="mid-rewrite, the dump is discarded"):
        await _drop_zero_pages(_dump(tmp_path, [b"a" * PAGE, bytes(PAGE), b"b" * PAGE, b"c" * PAGE]))
    assert _pagemap(tmp_path) == (3, [(0x10000, 4, 6)])


def _mixed_pages(n: int, seed: int) -> list[bytes]:
    """Zero pages, non-zero pages, and runs of zeros that start mid-page (a page's worth of zeros across
    a page boundary, which is no zero page): what the search for zero pages must tell apart."""
    import random

    rnd = random.Random(seed)
    half = PAGE // 2
    pages: list[bytes] = []
    for _ in range(n):
        kind = rnd.random()
        if kind < 0.35:
            pages.append(bytes(PAGE))
        elif kind < 0.55:  # its second half zero: with a next page starting with zeros, an unaligned run
            pages.append(rnd.randbytes(half).replace(b"\0", b"\1") + bytes(half))
        elif kind < 0.75:  # zeros but its last byte
            pages.append(bytes(PAGE - 1) + b"\1")
        else:
            pages.append(bytes(half) + rnd.randbytes(half).replace(b"\0", b"\2"))
    return pages


def _split_dump(tmp: Path, vaddr: int, split: int, pages: list[bytes]) -> None:
    """One process (pid 7), ``pages`` in one pagemap entry from ``vaddr`` across two VMAs: private
    anonymous memory up to ``split``, a private file mapping from there."""
    end = vaddr + len(pages) * PAGE
    _image(tmp / "pstree.img", sparse._PSTREE_MAGIC, [_msg((1, 7), (2, 0))])
    anon = _msg((1, vaddr), (2, split), (7, 1 << 9 | 1))
    file_backed = _msg((1, split), (2, end), (7, 1 << 6 | 1))
    _image(tmp / "mm-7.img", sparse._MM_MAGIC, [_msg((14, anon), (14, file_backed))])
    entry = _msg((1, vaddr), (2, len(pages)), (4, 6))
    _image(tmp / "pagemap-7.img", sparse._PAGEMAP_MAGIC, [_msg((1, 3)), entry])
    (tmp / "pages-3.img").write_bytes(b"".join(pages))


def test_a_rewrite_of_mixed_batches_keeps_exactly_the_non_zero_pages(tmp_path: Path) -> None:
    n, vaddr = 3 * sparse._BATCH_PAGES + 37, 0x10000
    pages = _mixed_pages(n, seed=5)
    split = vaddr + 500 * PAGE  # pages from here on lie in a private file mapping: all kept
    _split_dump(tmp_path, vaddr, split, pages)

    stats = drop_zero_pages(tmp_path)

    kept = [
        (vaddr + i * PAGE, p) for i, p in enumerate(pages) if p != bytes(PAGE) or vaddr + i * PAGE >= split
    ]
    assert stats.pages_dropped == n - len(kept)
    runs: list[tuple[int, int, int]] = []
    for addr, _ in kept:
        if runs and runs[-1][0] + runs[-1][1] * PAGE == addr:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, 6)
        else:
            runs.append((addr, 1, 6))
    assert _pagemap(tmp_path) == (3, runs)
    assert (tmp_path / "pages-3.img").read_bytes() == b"".join(p for _, p in kept)


def test_a_batch_of_zeros_across_a_vma_boundary_drops_only_the_anonymous_pages(tmp_path: Path) -> None:
    n, vaddr = 2 * sparse._BATCH_PAGES, 0x10000
    split = vaddr + 100 * PAGE  # a private file mapping from here: its zero pages are the file's
    _split_dump(tmp_path, vaddr, split, [bytes(PAGE)] * n)

    assert drop_zero_pages(tmp_path).pages_dropped == 100
    assert _pagemap(tmp_path) == (3, [(split, n - 100, 6)])
    assert (tmp_path / "pages-3.img").read_bytes() == bytes((n - 100) * PAGE)


# 8 MiB written with zeros (the rewrite empties it), 8 MiB of random bytes (it stays dense), and 8 MiB of
# which the first 3 are random and the rest zeros (under half left): each region's address and what the
# worker holds, before the dump and after the restore.
HUGE_WORKER = r"""
import ctypes, hashlib, mmap, os, sys, time
d, M = sys.argv[1], 1 << 20
regions = {name: mmap.mmap(-1, 8 * M, flags=mmap.MAP_PRIVATE) for name in ("zeros", "dense", "mixed")}
# The kernel places them side by side and would merge them into one VMA: the middle one's flags differ.
regions["dense"].madvise(mmap.MADV_DONTFORK)
regions["zeros"][:] = bytes(8 * M)
regions["dense"][:] = os.urandom(8 * M)
regions["mixed"][:] = os.urandom(3 * M) + bytes(5 * M)

def report(name, text):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))

def digest():
    return hashlib.sha256(b"".join(m[:] for m in regions.values())).hexdigest()

addrs = {n: ctypes.addressof(ctypes.c_char.from_buffer(m)) for n, m in regions.items()}
report("addresses", " ".join(f"{n}={a:x}" for n, a in addrs.items()))
report("before", digest())
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
report("after", digest())
while True:
    time.sleep(1)
"""


@pytest.mark.criu
@pytest.mark.parametrize("advise", [True, False])
async def test_memory_the_rewrite_emptied_is_marked_for_huge_pages(
    criu_bin: Path, tmp_path: Path, advise: bool
) -> None:
    work, images = tmp_path / "work", tmp_path / "images"
    proc = await start_script(HUGE_WORKER, work)
    restored_pid = None
    try:
        before = await asyncio.to_thread(wait_file, work / "before")
        text = await asyncio.to_thread(wait_file, work / "addresses")
        addrs = {name: int(a, 16) for name, a in (item.split("=") for item in text.split())}
        # Without the project's own advice for densely filled memory, which would mark the dense region.
        criu = Criu(criu_bin, restore_huge_pages=False)
        await criu.dump(proc.pid, images)
        await proc.wait()

        stats = await asyncio.to_thread(drop_zero_pages, images, advise_huge_pages=advise)
        assert stats.pages_dropped >= (8 + 5) * 256
        assert stats.unadvised == {}
        marked = {v.start for v in sparse._vmas(images, proc.pid) if v.madv & (1 << 14)}
        # The zeros and the mostly-zero region, not the dense one (nor any other of the process's).
        assert marked == ({addrs["zeros"], addrs["mixed"]} if advise else set())
        assert stats.huge_page_advice == len(marked)

        restored = await criu.restore(images, log_dir=tmp_path / "logs")
        restored_pid = restored.pid
        for name, start in addrs.items():
            flags = await asyncio.to_thread(smaps_field, restored_pid, start, "VmFlags")
            hugepage = "hg" in flags.split()
            assert hugepage == (start in marked), name
        (work / "go").touch()
        assert await asyncio.to_thread(wait_file, work / "after") == before
    finally:
        kill_groups(proc.pid, restored_pid)
