"""Handing a file's dirty pages to the disk ahead of an fsync."""

from __future__ import annotations

import os
from pathlib import Path

from dynamo_snapshot.fileio import start_writeback


def test_writeback_starts_on_the_range_and_refuses_a_bad_fd(tmp_path: Path) -> None:
    path = tmp_path / "pages.img"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, os.urandom(8 << 20))
        assert start_writeback(fd, 0, 4 << 20)
        assert start_writeback(fd, 4 << 20, 4 << 20)
        os.fsync(fd)
        assert os.pread(fd, 1, (8 << 20) - 1)
    finally:
        os.close(fd)
    assert not start_writeback(fd, 0, 4096)  # closed
