"""One restore's writing of a writable layer into a root filesystem directory: the part CRIU opens before
it, the rest beside it; a bad member in the rest fails ``finish``, ``abandon`` stops the rest, and a
restore cancelled during the first part leaves no file open once the thread ends."""

from __future__ import annotations

import asyncio
import os
import tarfile
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError
from dynamo_snapshot.agent.runtime.rootfs_diff import capture_diff
from dynamo_snapshot.agent.runtime.writable_layer import LayerWriting
from tests.helpers.polling import wait_for


def _layer(tmp_path: Path, files: int = 50) -> tuple[Path, Path]:
    upper = tmp_path / "upper"
    (upper / "cache").mkdir(parents=True)
    (upper / "cache" / "held.so").write_bytes(b"\x7fELF")
    for i in range(files):
        (upper / "cache" / f"k{i:05}.ptx").write_text(f"kernel {i}")
    diff = tmp_path / "rootfs-diff.tar"
    capture_diff(upper, diff, held={"/cache/held.so"})
    root = tmp_path / "root"
    root.mkdir()
    return diff, root


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_rest_is_written_beside_and_finish_waits_for_it(tmp_path: Path) -> None:
    diff, root = _layer(tmp_path)
    layer = LayerWriting()
    await layer.begin(diff, root, [])
    assert (root / "cache" / "held.so").exists()
    took = await layer.finish()
    assert took is not None
    assert len(list((root / "cache").iterdir())) == 51
    assert await layer.finish() is None


async def test_a_diff_without_the_count_is_written_before_begin_returns(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_text("f")
    capture_diff(upper, tmp_path / "d.tar")
    (tmp_path / "root").mkdir()
    layer = LayerWriting()
    await layer.begin(tmp_path / "d.tar", tmp_path / "root", [])
    assert (tmp_path / "root" / "f").read_text() == "f"
    assert await layer.finish() is None


async def test_a_bad_member_in_the_rest_fails_finish_naming_it(tmp_path: Path) -> None:
    diff, root = _layer(tmp_path)
    with tarfile.open(diff, "a") as tar:
        device = tarfile.TarInfo("cache/sda")
        device.type = tarfile.CHRTYPE
        tar.addfile(device)
    layer = LayerWriting()
    await layer.begin(diff, root, [])
    with pytest.raises(WorkloadRuntimeError, match="writable layer not applied: /cache/sda: the diff holds"):
        await layer.finish()


async def test_abandon_stops_the_rest_and_waits_for_it(tmp_path: Path) -> None:
    diff, root = _layer(tmp_path, files=3000)
    layer = LayerWriting()
    await layer.begin(diff, root, [])
    await layer.abandon()
    written = len(list((root / "cache").iterdir()))
    assert written < 3001, "the rest was written whole: abandon did not stop it"
    # Waited for: nothing more is written once abandon returned.
    await asyncio.sleep(0.3)
    assert len(list((root / "cache").iterdir())) == written
    assert await layer.finish() is None


async def test_a_restore_cancelled_in_the_first_part_leaves_nothing_open(tmp_path: Path) -> None:
    diff, root = _layer(tmp_path, files=10)
    before = _open_fds()
    began = asyncio.create_task(LayerWriting().begin(diff, root, []))
    await asyncio.sleep(0)
    began.cancel()
    with pytest.raises(asyncio.CancelledError):
        await began

    # The thread writes the first part to its end (its last file, held.so), then the event loop closes what
    # it opened: waited for off the loop.
    def closed() -> bool:
        return (root / "cache" / "held.so").exists() and _open_fds() <= before

    await asyncio.to_thread(wait_for, closed, 10, "the cancelled restore's diff and root to be closed", 0.01)
    assert _open_fds() == before
