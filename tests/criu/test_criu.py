"""Real CRIU: dump and restore a live process, and the errors CRIU's own log explains."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu, CriuError, CriuVersion
from tests.helpers.polling import wait_file

pytestmark = pytest.mark.criu

# 64 MiB that exist only in memory; the digest after restore proves CRIU brought every page back.
STATEFUL_PROCESS = r"""
import hashlib, os, sys, time
d = sys.argv[1]
state = bytearray(os.urandom(64 << 20))
with open(os.path.join(d, "before.tmp"), "w") as f:
    f.write(hashlib.sha256(state).hexdigest())
os.rename(os.path.join(d, "before.tmp"), os.path.join(d, "before"))
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
with open(os.path.join(d, "after.tmp"), "w") as f:
    f.write(f"{hashlib.sha256(state).hexdigest()} {os.getpid()}")
os.rename(os.path.join(d, "after.tmp"), os.path.join(d, "after"))
"""


async def _wait_file(path: Path) -> str:
    return await asyncio.to_thread(wait_file, path, 60)


def _free_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max - 1, 300, -1) if not Path(f"/proc/{p}").exists())


async def test_version_and_check(criu_bin: Path) -> None:
    criu = Criu(criu_bin)
    assert await criu.require() >= CriuVersion(4, 0)
    assert "Looks good" in await criu.check()


async def test_dump_restore_keeps_memory_and_pid(criu_bin: Path, tmp_path: Path) -> None:
    work, images, logs = tmp_path / "work", tmp_path / "images", tmp_path / "logs"
    work.mkdir()
    with (work / "stdout").open("w") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            STATEFUL_PROCESS,
            str(work),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    restored_pid = None
    try:
        before = await _wait_file(work / "before")
        criu = Criu(criu_bin)
        dump = await criu.dump(proc.pid, images)
        assert await proc.wait() == -signal.SIGKILL  # dump ends the original; the restore answers next
        assert dump.log_path == images / "dump.log"
        assert dump.image_bytes >= 64 << 20
        assert dump.seconds > 0

        # The images directory stays as dumped: logs, stats and the pidfile go to log_dir.
        images_before = sorted(p.name for p in images.iterdir())
        restored = await criu.restore(images, log_dir=logs)
        restored_pid = restored.pid
        assert restored.pid == proc.pid
        assert restored.log_path == logs / "restore.log"
        assert restored.log_path.is_file()
        assert sorted(p.name for p in images.iterdir()) == images_before

        (work / "go").touch()
        after_digest, after_pid = (await _wait_file(work / "after")).split()
        assert after_digest == before
        assert int(after_pid) == proc.pid
    finally:
        for pid in {proc.pid, restored_pid} - {None}:
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_dump_missing_pid_quotes_log(criu_bin: Path, tmp_path: Path) -> None:
    pid = _free_pid()
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin).dump(pid, tmp_path / "images")
    e = err.value
    assert e.op == "dump"
    assert e.returncode == 1
    assert e.log_path == tmp_path / "images" / "dump.log"
    assert str(pid) in e.message
    assert any(str(pid) in line for line in e.log_excerpt)
    text = str(e)
    assert text.startswith(f"criu dump failed (exit 1): {e.message}")
    assert f"/proc/{pid}" in text


async def test_restore_empty_images_dir(criu_bin: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin).restore(images, log_dir=tmp_path / "logs")
    assert err.value.op == "restore"
    assert err.value.log_path == tmp_path / "logs" / "restore.log"
    assert err.value.log_excerpt
    assert "inventory" in str(err.value) or "empty-image" in str(err.value)


async def test_restore_garbage_images(criu_bin: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "inventory.img").write_bytes(os.urandom(4096))
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin).restore(images)
    assert err.value.log_excerpt
    assert "Error" in str(err.value)
    assert "exit code" not in str(err.value)


async def test_restore_missing_images_dir_uses_stderr(criu_bin: Path, tmp_path: Path) -> None:
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin).restore(tmp_path / "nope", log_dir=tmp_path / "logs")
    assert err.value.log_excerpt
    assert "nope" in str(err.value)
