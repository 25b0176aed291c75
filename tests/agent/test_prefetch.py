"""The prefetch plan: which pages of which node files a process has mapped (read from the kernel's
pagemap of a real process), and the restore-time read-ahead that skips files that changed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo_snapshot.agent.prefetch import (
    PAGE,
    PrefetchFile,
    PrefetchPlan,
    plan_for_tree,
    prefetch,
    read_plan,
    read_whole,
    write_plan,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="procfs")


def _covers(entry: PrefetchFile, offset: int) -> bool:
    return any(off <= offset < off + length for off, length in entry.ranges)


def _mapping_child(path: Path, touch_pages: list[int]) -> subprocess.Popen[bytes]:
    """A process that maps `path`, reads the given pages and waits."""
    code = (
        "import mmap, sys\n"
        f"f = open({str(path)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        f"for p in {touch_pages!r}: m[p * {PAGE}]\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    return child


def test_plan_holds_the_pages_a_process_touched(tmp_path: Path) -> None:
    data = tmp_path / "model.bin"
    with data.open("wb") as f:
        f.write(os.urandom(4096 * PAGE))
        f.flush()
        os.fsync(f.fileno())
        # Out of the page cache, so that only what the child reads (and its read-around) is mapped.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    child = _mapping_child(data, [0, 3000])
    try:
        plan = plan_for_tree([child.pid])
    finally:
        child.kill()
        child.wait()
    entry = next(f for f in plan.files if f.path == str(data))
    assert entry.size == 4096 * PAGE
    assert entry.mtimeNs == data.stat().st_mtime_ns
    assert _covers(entry, 0)
    assert _covers(entry, 3000 * PAGE)
    # Read-around maps some neighbours (whole folios), never the untouched middle of the file.
    assert not _covers(entry, 1500 * PAGE)
    assert all(off % PAGE == 0 and off + length <= entry.size for off, length in entry.ranges)
    # The interpreter itself is a mapped node file too.
    assert any(Path(f.path).name.startswith(("python", "libpython")) for f in plan.files)
    assert plan.bytes == sum(length for f in plan.files for _, length in f.ranges)


def test_plan_skips_a_process_that_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert plan_for_tree([child.pid]).files == []


def test_plan_round_trips_and_bad_plans_are_refused(tmp_path: Path) -> None:
    plan = PrefetchPlan(files=[PrefetchFile(path="/x", size=10, mtimeNs=1, ranges=[(0, 10)])], unresolved=2)
    assert read_plan(write_plan(plan, tmp_path)) == plan
    (tmp_path / "bad.json").write_text('{"version": 1, "files": [{"path": "/x"}]}')
    with pytest.raises(ValueError, match="size"):
        read_plan(tmp_path / "bad.json")


def test_prefetch_reads_matching_files_and_skips_changed_or_missing_ones(tmp_path: Path) -> None:
    same = tmp_path / "same.so"
    same.write_bytes(b"\0" * (64 * PAGE))
    changed = tmp_path / "changed.so"
    changed.write_bytes(b"\0" * (8 * PAGE))
    st = changed.stat()
    plan = PrefetchPlan(
        files=[
            PrefetchFile(
                path=str(same), size=64 * PAGE, mtimeNs=same.stat().st_mtime_ns, ranges=[(0, 16 * PAGE)]
            ),
            # Recorded before the node's copy changed: another mtime.
            PrefetchFile(path=str(changed), size=st.st_size, mtimeNs=st.st_mtime_ns - 1, ranges=[(0, PAGE)]),
            PrefetchFile(path=str(tmp_path / "gone.so"), size=1, mtimeNs=0, ranges=[(0, 1)]),
        ]
    )
    started = time.monotonic()
    stats = prefetch(plan)
    assert (stats.files, stats.bytes, stats.skipped) == (1, 16 * PAGE, 2)
    assert 0 <= stats.seconds <= time.monotonic() - started


def test_read_whole_reads_files_and_counts_missing_ones(tmp_path: Path) -> None:
    tool = tmp_path / "criu"
    tool.write_bytes(b"\x7fELF" + b"\0" * (3 << 20))
    stats = read_whole([tool, tmp_path / "libgone.so"])
    assert (stats.files, stats.bytes, stats.skipped) == (1, 4 + (3 << 20), 1)


def test_plan_leaves_out_the_largest_files_beyond_its_cap(tmp_path: Path) -> None:
    data = tmp_path / "dataset.bin"
    data.write_bytes(os.urandom(4096 * PAGE))
    child = _mapping_child(data, list(range(4096)))  # every page of it mapped: 16 MiB
    try:
        full = plan_for_tree([child.pid])
        capped = plan_for_tree([child.pid], max_bytes=full.bytes - 1)
    finally:
        child.kill()
        child.wait()
    assert max(full.files, key=lambda f: sum(n for _, n in f.ranges)).path == str(data)
    assert str(data) not in {f.path for f in capped.files}
    assert capped.bytes <= full.bytes - 1
    assert capped.omittedBytes + capped.bytes == full.bytes
    assert full.omittedBytes == 0
