"""The I/O priority of a thread, set through the kernel and read back from it; a hash pool at idle
priority still hashes correctly."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import pytest

from dynamo_snapshot.fileio import HashJob, hash_files
from dynamo_snapshot.fileio.ioprio import BEST_EFFORT_DEFAULT, IDLE, get_thread_ioprio, set_thread_ioprio

linux = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"), reason="ioprio_set(2)"
)


@linux
def test_a_thread_goes_idle_and_back_without_touching_others() -> None:
    seen: dict[str, int | None] = {}

    def worker() -> None:
        assert set_thread_ioprio(IDLE)
        seen["idle"] = get_thread_ioprio()
        assert set_thread_ioprio(BEST_EFFORT_DEFAULT)
        seen["back"] = get_thread_ioprio()

    before = get_thread_ioprio()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"idle": IDLE, "back": BEST_EFFORT_DEFAULT}
    assert get_thread_ioprio() == before  # per thread: the caller kept its own


@linux
def test_an_idle_hash_pool_hashes_the_same(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    f = tmp_path / "pages-1.img"
    f.write_bytes(data)
    job = HashJob(src=f, size=len(data), chunk_bytes=1 << 20)
    idle, normal = (hash_files([job], idle_io=flag)[0] for flag in (True, False))
    expected = tuple(
        hashlib.sha256(data[i : i + (1 << 20)]).hexdigest() for i in range(0, len(data), 1 << 20)
    )
    assert idle.digests == normal.digests == expected
