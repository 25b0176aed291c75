"""A failed CRIU run's log is kept where its error message points, capped in size and in number, also
when the directory CRIU wrote it into is gone; with real CRIU where CRIU is needed."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu, CriuError
from dynamo_snapshot.criu.kept_logs import keep_log


def _log(path: Path, lines: int) -> list[str]:
    text = [f"({n:08d}.000000) line {n} of the log" for n in range(lines)]
    path.write_text("\n".join(text) + "\n")
    return text


def test_a_small_log_is_kept_whole(tmp_path: Path) -> None:
    lines = _log(tmp_path / "dump.log", 10)
    kept = keep_log(tmp_path / "dump.log", tmp_path / "kept", "dump")
    assert kept.parent == tmp_path / "kept"
    assert kept.name.startswith("dump-")
    assert kept.name.endswith(".log")
    assert kept.read_text().splitlines() == lines
    assert kept.stat().st_mode & 0o777 == 0o600


def test_a_large_log_keeps_its_last_whole_lines_within_the_cap(tmp_path: Path) -> None:
    lines = _log(tmp_path / "restore.log", 100_000)  # about 3.4 MB
    size = (tmp_path / "restore.log").stat().st_size
    kept = keep_log(tmp_path / "restore.log", tmp_path / "kept", "restore", max_bytes=64 << 10)
    head, *rest = kept.read_text().splitlines()
    said = re.fullmatch(r"\[the first (\d+) of (\d+) bytes of .*restore\.log are left out\]", head)
    assert said is not None, head
    left_out = int(said[1])
    assert int(said[2]) == size
    assert size - left_out <= 64 << 10
    assert rest == lines[-len(rest) :], "whole lines, the log's last"
    assert len(rest) > 1000
    assert kept.stat().st_size <= (64 << 10) + len(head) + 1


def test_only_the_newest_logs_are_kept(tmp_path: Path) -> None:
    _log(tmp_path / "dump.log", 3)
    kept = [keep_log(tmp_path / "dump.log", tmp_path / "kept", "dump", keep=3) for _ in range(5)]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == sorted(p.name for p in kept[-3:])


def test_a_name_planted_in_the_directory_is_not_followed(tmp_path: Path) -> None:
    _log(tmp_path / "dump.log", 3)
    (tmp_path / "kept").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "kept" / "planted.txt").symlink_to(victim)
    kept = keep_log(tmp_path / "dump.log", tmp_path / "kept", "dump", keep=1)
    assert victim.read_text() == "untouched"
    assert kept.exists()
    assert not kept.is_symlink()


def _free_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max - 1, 300, -1) if not Path(f"/proc/{p}").exists())


@pytest.mark.criu
async def test_a_failed_dump_names_its_kept_log_which_outlives_the_work_dir(
    criu_bin: Path, tmp_path: Path
) -> None:
    work, kept = tmp_path / "staging", tmp_path / "criu-logs"
    pid = _free_pid()
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin, kept_logs=kept).dump(pid, work / "images", log_dir=work)
    shutil.rmtree(work)  # as the agent discards a failed dump's staging directory
    e = err.value
    assert e.log_path is not None
    assert e.log_path.parent == kept
    assert f"from the log {e.log_path}:" in str(e)
    text = e.log_path.read_text()
    assert str(pid) in text
    assert all(line in text for line in e.log_excerpt)


@pytest.mark.criu
async def test_a_failed_restore_names_its_kept_log(criu_bin: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "inventory.img").write_bytes(os.urandom(4096))
    with pytest.raises(CriuError) as err:
        await Criu(criu_bin, kept_logs=tmp_path / "criu-logs").restore(images, log_dir=tmp_path / "work")
    shutil.rmtree(tmp_path / "work")
    kept = err.value.log_path
    assert kept is not None
    assert kept.parent == tmp_path / "criu-logs"
    assert kept.name.startswith("restore-")
    assert f"from the log {kept}:" in str(err.value)
    assert kept.read_text().strip()
