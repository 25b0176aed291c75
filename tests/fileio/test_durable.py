"""write_atomic in a directory someone else may write: what is planted there is never written through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_snapshot.fileio import durable, write_atomic


def test_a_link_planted_at_the_temporary_name_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who guesses (here: is handed) the next temporary name plants a link there first."""
    tokens = iter(["guessed", "fresh"])
    monkeypatch.setattr(durable.secrets, "token_hex", lambda _n: next(tokens))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    path = tmp_path / "ready.json"
    (tmp_path / ".ready.json.guessed.tmp").symlink_to(target)
    write_atomic(path, b"new", mode=0o640, durable=False)
    assert target.read_bytes() == b"keep"
    assert not path.is_symlink()
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o640
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".ready.json.guessed.tmp", "elsewhere", "ready.json"]


def test_the_mode_is_the_one_asked_for_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "f", b"x", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")
    os.mkdir(tmp_path / "d")
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "d", b"new")  # the rename over a directory fails after the write
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
