"""Paths a tenant controls resolve beneath the directory or not at all, with openat2 and without it."""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.fileio import beneath
from dynamo_snapshot.fileio.beneath import (
    UnsafePath,
    lstat_beneath,
    open_dirs_beneath,
    open_regular_beneath,
    opened_dir,
    reopen,
)


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs with the kernel's openat2 and with the O_NOFOLLOW walk used where it is missing."""
    if request.param == "walk":
        monkeypatch.setattr(beneath, "_have_openat2", False)
    else:
        monkeypatch.setattr(beneath, "_have_openat2", None)
    yield request.param
    if request.param == "openat2":
        assert beneath._have_openat2 is not False, "this kernel refused openat2: only the walk was tested"


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A control directory and, beside it, the host's files it must never reach."""
    ctl, host = tmp_path / "ctl", tmp_path / "host"
    (ctl / "sub").mkdir(parents=True)
    host.mkdir()
    (host / "secret").write_text("host secret")
    (ctl / "sub" / "file").write_text("tenant data")
    return ctl, host


def _read(ctl: Path, rel: str) -> str:
    with opened_dir(ctl) as d:
        handle = open_regular_beneath(d, rel)
        try:
            fd = reopen(handle)
        finally:
            os.close(handle)
    with os.fdopen(fd) as f:
        return f.read()


def test_a_regular_file_inside_is_read(resolution: str, tree: tuple[Path, Path]) -> None:
    ctl, _ = tree
    assert _read(ctl, "sub/file") == "tenant data"
    assert _read(ctl, "./sub/./file") == "tenant data"


@pytest.mark.parametrize(
    ("plant", "message", "code"),
    [
        (lambda ctl, host: (ctl / "link").symlink_to(host / "secret"), "symbolic link", errno.ELOOP),
        (lambda ctl, host: (ctl / "link").symlink_to("sub/file"), "symbolic link", errno.ELOOP),
        (lambda ctl, host: os.link(host / "secret", ctl / "link"), "2 hard links", errno.EMLINK),
        (lambda ctl, host: os.mkfifo(ctl / "link"), "is a FIFO", errno.EINVAL),
        (
            lambda ctl, host: os.mknod(ctl / "link", stat.S_IFCHR | 0o600, os.makedev(1, 3)),
            "is a character device",
            errno.EINVAL,
        ),
        (lambda ctl, host: (ctl / "link").mkdir(), "is a directory", errno.EINVAL),
    ],
    ids=["link-out", "link-in", "hard-link", "fifo", "device", "directory"],
)
def test_anything_but_a_regular_file_with_one_name_is_refused(
    resolution: str, tree: tuple[Path, Path], plant: object, message: str, code: int
) -> None:
    ctl, host = tree
    plant(ctl, host)  # type: ignore[operator]
    done = threading.Event()
    refused: list[UnsafePath] = []

    def attempt() -> None:
        with pytest.raises(UnsafePath, match=message) as e:
            _read(ctl, "link")
        refused.append(e.value)
        done.set()

    threading.Thread(target=attempt, daemon=True).start()
    assert done.wait(5), "resolving the planted name blocked"
    assert refused[0].errno == code
    assert (host / "secret").read_text() == "host secret"


def test_a_directory_link_on_the_way_is_refused(resolution: str, tree: tuple[Path, Path]) -> None:
    ctl, host = tree
    (ctl / "out").symlink_to(host)
    with pytest.raises(UnsafePath, match="symbolic link"):
        _read(ctl, "out/secret")
    with opened_dir(ctl) as d, pytest.raises(UnsafePath, match="symbolic link"):
        open_dirs_beneath(d, "out/new", create=True)
    assert sorted(p.name for p in host.iterdir()) == ["secret"]


@pytest.mark.parametrize("rel", ["../host/secret", "sub/../../host/secret", "/etc/passwd", "", "."])
def test_paths_that_leave_or_name_nothing_are_refused(
    resolution: str, tree: tuple[Path, Path], rel: str
) -> None:
    ctl, _ = tree
    with pytest.raises(UnsafePath, match=r"'\.\.'|absolute|names no file"):
        _read(ctl, rel)


def test_directories_are_made_beneath_without_following(resolution: str, tree: tuple[Path, Path]) -> None:
    ctl, _ = tree
    with opened_dir(ctl) as d:
        fd = open_dirs_beneath(d, "a/b/c", create=True)
        try:
            assert os.path.samefile(f"/proc/self/fd/{fd}", ctl / "a" / "b" / "c")
        finally:
            os.close(fd)
        (ctl / "a" / "f").write_text("x")
        with pytest.raises(UnsafePath, match="not a directory"):
            open_dirs_beneath(d, "a/f/g", create=True)
        with pytest.raises(FileNotFoundError):
            open_dirs_beneath(d, "missing/dir", create=False)
    assert not (ctl / "missing").exists()


def test_lstat_sees_a_link_as_itself(tree: tuple[Path, Path]) -> None:
    ctl, host = tree
    (ctl / "link").symlink_to(host / "secret")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ctl / "sock"))
    with opened_dir(ctl) as d:
        st = lstat_beneath(d, "link")
        assert st is not None
        assert stat.S_ISLNK(st.st_mode)
        st = lstat_beneath(d, "sock")
        assert st is not None
        assert beneath.kind_of(st.st_mode) == "a socket"
        assert lstat_beneath(d, "absent") is None
        with pytest.raises(UnsafePath):
            lstat_beneath(d, "sub/file")
    sock.close()


def test_the_control_directory_itself_must_not_be_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "ctl").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match=r"Not a directory|symbolic links") as e:
        beneath.open_dir(tmp_path / "ctl")
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
