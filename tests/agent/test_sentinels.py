"""What a tenant can plant in its control directory does not steer the agent's writes or reads."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest

from dynamo_snapshot.agent.sentinels import write_sentinel
from dynamo_snapshot.fileio.beneath import read_json_beneath


def test_a_link_planted_at_the_sentinel_is_replaced_not_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "node-file"
    outside.write_text("keep me")
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "restore-complete").symlink_to(outside)
    write_sentinel(ctl / "restore-complete", {"podName": "p"})
    assert outside.read_text() == "keep me"
    assert not (ctl / "restore-complete").is_symlink()
    assert json.loads((ctl / "restore-complete").read_text()) == {"podName": "p"}
    assert oct((ctl / "restore-complete").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in ctl.iterdir()) == ["restore-complete"]  # no temporary left


def test_worker_json_is_read_from_a_regular_file_only_and_never_blocks(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "x"}')
    (tmp_path / "link").symlink_to(secret)
    with pytest.raises(OSError, match="symbolic link") as refused:
        read_json_beneath(tmp_path / "link", 1024)
    assert refused.value.errno == errno.ELOOP
    os.mkfifo(tmp_path / "fifo")
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(OSError, match="not a regular file"):
            read_json_beneath(tmp_path / "fifo", 1024)
        done.set()

    threading.Thread(target=read_fifo, daemon=True).start()
    assert done.wait(5), "reading a FIFO blocked"
    (tmp_path / "big").write_text(json.dumps({"x": "y" * 2000}))
    with pytest.raises(ValueError, match="longer than"):
        read_json_beneath(tmp_path / "big", 1024)
    assert read_json_beneath(secret, 1024) == {"token": "x"}
