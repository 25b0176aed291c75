"""The SDK's side of the zero-page release, on this process's own memory."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random

from dynamo_snapshot.workload.zero_pages import answer_request, read_maps, release_zero_pages

PAGE = mmap.PAGESIZE


def _mapping(pages: int, marked: range) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(bytes(pages * PAGE))  # every page present, as the driver's copy leaves them
    for i in marked:
        m[i * PAGE + 11] = 3
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_zero_pages_are_given_back_and_every_other_byte_stays() -> None:
    pages = 4096
    marked = range(0, pages, 5)
    m, addr = _mapping(pages, marked)
    stats = release_zero_pages([(addr, addr + pages * PAGE)])
    assert stats.refused == []
    assert stats.released_bytes == (pages - len(marked)) * PAGE
    # Given back: a second pass finds nothing present to release (before anything reads them again).
    assert release_zero_pages([(addr, addr + pages * PAGE)]).released_bytes == 0
    assert all(m[i * PAGE + 11] == (3 if i % 5 == 0 else 0) for i in range(pages))


def test_every_zero_run_is_found_whole_across_chunks_and_no_marked_byte_is_lost() -> None:
    """Runs that start, end and continue across the scan's 1 MiB chunks; marks on bytes the scan does
    not sample; pages never touched (not present, so not counted as released)."""
    rng = random.Random(7)
    pages = 3 * 256 + 17
    marked: list[tuple[int, int]] = []
    zero = [True] * pages
    i = 0
    while i < pages:
        length = rng.choice([1, 1, 2, 3, 255, 256, 257, 300])
        if rng.random() < 0.5:
            for j in range(i, min(i + length, pages)):
                marked.append((j, rng.randrange(PAGE)))
                zero[j] = False
        i += length
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    untouched = set(rng.sample([j for j in range(pages) if zero[j]], 40))
    for j in range(pages):
        if j not in untouched:
            m[j * PAGE] = 0  # a write makes the page present
    for j, off in marked:
        m[j * PAGE + off] = 1 + off % 255
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    runs = sum(1 for j in range(pages) if zero[j] and (j == 0 or not zero[j - 1]))

    stats = release_zero_pages([(addr, addr + pages * PAGE)])

    assert stats.runs == runs
    assert stats.released_bytes == (zero.count(True) - len(untouched)) * PAGE
    assert all(m[j * PAGE + off] == 1 + off % 255 for j, off in marked)
    assert m[:].count(0) == pages * PAGE - len(marked)


def test_ranges_outside_private_anonymous_writable_memory_are_refused_untouched() -> None:
    _kept, addr = _mapping(65, range(65))
    # The last page read-only: a range over it leaves the writable mapping (a neighbour the kernel merged
    # with it could not make that range valid).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(addr + 64 * PAGE, PAGE, mmap.PROT_READ) == 0
    shared = mmap.mmap(-1, 64 * PAGE)  # shared anonymous: a dropped page would not read as zero
    shared_addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    code = next(x for x in read_maps() if x.perms.startswith("r-x") and x.name.startswith("/"))
    bad = [
        (addr + 1, addr + PAGE + 1),  # not page-aligned
        (addr, addr + 65 * PAGE),  # runs past the writable mapping
        (shared_addr, shared_addr + 64 * PAGE),
        (code.start, code.end),
        (PAGE, 2 * PAGE),  # nothing mapped there
        (addr + PAGE, addr + PAGE),  # empty
    ]
    stats = release_zero_pages(bad)
    assert stats.refused == bad
    assert stats.scanned_bytes == stats.released_bytes == 0


def test_requests_for_another_process_are_left_and_bad_ones_answered_with_their_error() -> None:
    me = os.getpid()
    assert answer_request(json.dumps({"pid": me + 1, "ranges": []}).encode()) is None
    for body, error in (
        (b"not json", "Expecting value"),
        (b"[]", '"pid"'),
        (json.dumps({"pid": me, "ranges": [[1]]}).encode(), "pair"),
        (json.dumps({"pid": me, "ranges": [[1, -2]]}).encode(), "pair"),
        (json.dumps({"pid": me, "ranges": [[0, 1]] * 5000}).encode(), "at most"),
    ):
        answer = answer_request(body)
        assert answer is not None, body[:40]
        assert error in str(answer["error"]), body[:40]
    _kept, addr = _mapping(16, range(0))
    answer = answer_request(json.dumps({"pid": me, "ranges": [[addr, addr + 16 * PAGE]]}).encode())
    assert answer is not None
    assert answer["releasedBytes"] == 16 * PAGE
