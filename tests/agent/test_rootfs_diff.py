"""The writable-layer diff: captured from a real overlayfs upperdir and applied into another real overlay's
merged tree, which must then equal the source's; applying refuses paths that leave the tree, symlinks on
the way, tars that are not a diff and members of other types, and leaves excluded paths alone."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.rootfs_diff import (
    HEADER_NAME,
    DiffApply,
    RootfsDiffError,
    apply_diff,
    capture_diff,
    overlay_upperdir,
)

Tree = dict[str, tuple[object, ...]]
Mount = Callable[[Path, Path], Path]


def _tree(root: Path) -> Tree:
    """Every path under `root` (links not followed): type, mode, owner, and content or link target."""
    out: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st, rel = path.lstat(), str(path.relative_to(root))
            owner = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path), st.st_uid, st.st_gid)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", *owner)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", *owner, st.st_mtime_ns, path.read_bytes())
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def _diff_tar(
    path: Path,
    members: Sequence[tuple[str, str, bytes | str]] = (),
    *,
    deleted: Sequence[str] = (),
    opaque: Sequence[str] = (),
    header: dict[str, object] | None = None,
    with_header: bool = True,
) -> Path:
    """A diff tar written by hand: members are (name, "file" | "dir" | "sym" | "chr", data or target)."""
    types = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "chr": tarfile.CHRTYPE}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        if with_header:
            doc = header if header is not None else {"format": 1, "deleted": deleted, "opaque": opaque}
            raw = json.dumps(doc).encode()
            info = tarfile.TarInfo(HEADER_NAME)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = types[kind], 0o755, os.getuid(), os.getgid()
            if kind == "file":
                assert isinstance(data, bytes)
                info.mode, info.size = 0o640, len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.linkname = str(data)
            tar.addfile(info)
    return path


@pytest.fixture
def mount_overlay() -> Iterator[Mount]:
    """Mount an overlay of `lower` with its upper, work and merged directories under `base`."""
    mounted: list[Path] = []

    def mount(lower: Path, base: Path) -> Path:
        upper, work, merged = base / "upper", base / "work", base / "merged"
        for d in (upper, work, merged):
            d.mkdir(parents=True)
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], capture_output=True, text=True
        )
        if done.returncode != 0:
            err = done.stderr.strip()
            refused = ("permission denied", "not permitted", "must be superuser", "unknown filesystem type")
            if any(word in err.lower() for word in refused):
                pytest.skip(f"this machine cannot mount overlayfs (EPERM/ENODEV): {err}")
            pytest.fail(f"mount -t overlay failed: {err}")
        mounted.append(merged)
        return merged

    yield mount
    for merged in reversed(mounted):
        subprocess.run(["umount", str(merged)], check=True)


def _lower(root: Path) -> Path:
    (root / "olddir").mkdir(parents=True)
    (root / "deaddir").mkdir()
    (root / "sub").mkdir()
    (root / "keep.txt").write_text("keep")
    (root / "change.txt").write_text("old")
    (root / "gone.txt").write_text("bye")
    (root / "olddir" / "a").write_text("a")
    (root / "olddir" / "b").write_text("b")
    (root / "deaddir" / "x").write_text("x")
    (root / "sub" / "inner.txt").write_text("inner")
    return root


def test_real_overlay_round_trip(tmp_path: Path, mount_overlay: Mount) -> None:
    lower = _lower(tmp_path / "lower")
    source = mount_overlay(lower, tmp_path / "source")
    (source / "new.txt").write_text("new")
    os.link(source / "new.txt", source / "new-hard.txt")
    (source / "change.txt").write_text("changed!!")
    (source / "change.txt").chmod(0o600)
    (source / "gone.txt").unlink()
    shutil.rmtree(source / "olddir")
    (source / "olddir").mkdir(mode=0o750)
    (source / "olddir" / "c").write_text("c")
    shutil.rmtree(source / "deaddir")
    (source / "link").symlink_to("keep.txt")
    (source / "abs-link").symlink_to("/etc/passwd")
    (source / "sub" / "new.txt").write_text("sub new")
    (source / "setuid.bin").write_bytes(b"\x7fELF")
    os.chown(source / "setuid.bin", 1234, 5678)
    os.chmod(source / "setuid.bin", 0o4755)
    os.mkfifo(source / "fifo")
    upper = tmp_path / "source" / "upper"
    assert stat.S_ISCHR((upper / "gone.txt").lstat().st_mode)  # the kernel wrote a whiteout

    diff = tmp_path / "rootfs-diff.tar"
    captured = capture_diff(upper, diff)
    assert captured.skipped == ("/fifo",)
    assert captured.deleted == 2
    with tarfile.open(diff) as tar:
        first = tar.next()
        assert first is not None
        assert first.name == HEADER_NAME
        src = tar.extractfile(first)
        assert src is not None
        doc = json.loads(src.read())
        mtimes = doc.pop("mtimes")
        assert doc == {"format": 2, "deleted": ["deaddir", "gone.txt"], "opaque": ["olddir"]}
        members = {m.name: m for m in tar.getmembers()[1:]}
    # The sub-second mtimes ride in the header, so no member needs a PAX header of its own.
    assert mtimes["new.txt"] == (upper / "new.txt").lstat().st_mtime_ns
    assert all(not m.pax_headers for m in members.values())
    assert members["new-hard.txt"].isreg()
    assert members["new.txt"].isreg()
    assert members["link"].issym()
    assert members["link"].linkname == "keep.txt"
    assert "olddir/a" not in members
    assert capture_diff(upper, tmp_path / "again.tar") == captured
    assert (tmp_path / "again.tar").read_bytes() == diff.read_bytes()

    target = mount_overlay(shutil.copytree(lower, tmp_path / "lower2", symlinks=True), tmp_path / "target")
    assert _tree(target) != _tree(source)
    applied = apply_diff(diff, target)
    assert applied.deleted == 4  # gone.txt, deaddir, and olddir's a and b
    assert applied.files == captured.files
    assert applied.bytes == captured.bytes == sum(m.size for m in members.values())
    expected = _tree(source)
    assert expected.pop("fifo") == ("other", stat.S_IFIFO)
    assert _tree(target) == expected
    assert (target / "setuid.bin").stat().st_mode & 0o7777 == 0o4755
    assert not (target / "olddir" / "a").exists()
    assert not (target / "deaddir").exists()


def test_upperdir_from_the_real_mountinfo_line(tmp_path: Path, mount_overlay: Mount) -> None:
    merged = mount_overlay(_lower(tmp_path / "lower"), tmp_path / "ovl")
    lines = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {merged} " in ln]
    assert len(lines) == 1
    fields = lines[0].split(" ")
    fields[4] = "/"  # as the container's own mountinfo shows its root
    assert overlay_upperdir(" ".join(fields)) == tmp_path / "ovl" / "upper"


MOUNTS = """\
22 28 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
99 63 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/a/2/fs:/a/1/fs,upperdir=/a/4/fs,\
workdir=/a/4/work,uuid=on
100 99 0:52 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
105 99 254:0 /var/lib/kubelet/pods/p/etc-hosts /etc/hosts rw,relatime - ext4 /dev/vda rw
"""


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [
        (MOUNTS, Path("/a/4/fs")),
        (
            "99 63 0:50 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/my\\040layers/1:/b,"
            "upperdir=/my\\040layers/up\\054per,workdir=/my\\040layers/work\n",
            Path("/my layers/up,per"),
        ),
        ("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resuid=65534\n", None),
        ("99 63 0:50 / / ro,relatime - overlay overlay ro,lowerdir=/a/2/fs:/a/1/fs\n", None),
        ("99 63 0:50 / /merged rw - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n", None),
        # A later mount on "/" covers an earlier one.
        (MOUNTS + "120 99 0:60 / / rw - ext4 /dev/vdb rw\n", None),
        ("", None),
    ],
    ids=["containerd", "escaped", "ext4-root", "no-upper", "not-root", "covered", "empty"],
)
def test_overlay_upperdir(mountinfo: str, expected: Path | None) -> None:
    assert overlay_upperdir(mountinfo) == expected


def test_capture_excludes_mount_points_and_skips_special_files(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    for d in ("etc", "dev", "snapshot-control/sub", "app"):
        (upper / d).mkdir(parents=True)
    (upper / "etc" / "hosts").write_text("hosts")
    (upper / "etc" / "app.conf").write_text("conf")
    (upper / "snapshot-control" / "sub" / "f").write_text("f")
    (upper / "app" / "out").write_text("out")
    os.mkfifo(upper / "app" / "pipe")
    stats = capture_diff(upper, tmp_path / "d.tar", exclude=["/etc/hosts", "/dev/", "snapshot-control"])
    with tarfile.open(tmp_path / "d.tar") as tar:
        names = tar.getnames()
    assert names == [HEADER_NAME, "app", "app/out", "etc", "etc/app.conf"]
    assert stats.skipped == ("/app/pipe", "/dev", "/etc/hosts", "/snapshot-control")
    assert (stats.files, stats.bytes, stats.deleted) == (4, 7, 0)


def test_apply_leaves_excluded_paths_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for d in ("etc", "run/secrets", "snapshot-control"):
        (root / d).mkdir(parents=True)
    (root / "etc" / "hosts").write_text("target hosts")
    (root / "etc" / "old").write_text("old")
    (root / "run" / "secrets" / "token").write_text("token")
    (root / "run" / "other").write_text("other")
    (root / "snapshot-control" / "ready").write_text("")
    diff = _diff_tar(
        tmp_path / "d.tar",
        [("etc", "dir", ""), ("etc/hosts", "file", b"source hosts"), ("etc/new", "file", b"new")],
        deleted=["run", "snapshot-control"],
        opaque=["etc"],
    )
    stats = apply_diff(diff, root, exclude=["/etc/hosts", "/run/secrets", "/snapshot-control"])
    assert (root / "etc" / "hosts").read_text() == "target hosts"
    assert not (root / "etc" / "old").exists()
    assert (root / "etc" / "new").read_text() == "new"
    assert (root / "run" / "secrets" / "token").read_text() == "token"
    assert not (root / "run" / "other").exists()
    assert (root / "snapshot-control" / "ready").exists()
    assert set(stats.skipped) == {"/etc/hosts", "/run/secrets", "/snapshot-control"}
    assert (stats.files, stats.deleted) == (2, 2)


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("../escape", "member"),
        ("a/../../escape", "member"),
        ("/escape", "member"),
        ("a/./b", "member"),
        ("../escape", "deleted"),
        ("/escape", "opaque"),
        ("", "deleted"),
    ],
)
def test_apply_refuses_paths_out_of_the_tree(tmp_path: Path, name: str, where: str) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "escape").write_text("outside")
    members: list[tuple[str, str, bytes | str]] = [(name, "file", b"evil")] if where == "member" else []
    lists = {"deleted": [name] if where == "deleted" else [], "opaque": [name] if where == "opaque" else []}
    diff = _diff_tar(tmp_path / "d.tar", members, deleted=lists["deleted"], opaque=lists["opaque"])
    with pytest.raises(
        RootfsDiffError, match=rf"^rootfs diff {where} (path )?{re.escape(repr(name))}: not a"
    ):
        apply_diff(diff, root)
    assert (tmp_path / "escape").read_text() == "outside"
    assert list(root.iterdir()) == [root / "a"]


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path, Tree]:
    """A target root whose /etc is a symlink to a directory outside it, and that directory's contents."""
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    (outside / "passwd").write_text("host passwd")
    (outside / "shadow").write_text("host shadow")
    root.mkdir()
    (root / "etc").symlink_to(outside)
    return root, outside, _tree(outside)


@pytest.mark.parametrize(
    ("members", "deleted", "opaque"),
    [
        ([("etc/passwd", "file", b"owned")], [], []),
        ([("etc/cron.d", "dir", ""), ("etc/cron.d/job", "file", b"* * * * * evil")], [], []),
        ([("etc/ld.so.preload", "sym", "/evil.so")], [], []),
        ([], ["etc/shadow"], []),
        ([], ["etc/x/y"], []),
    ],
    ids=["file", "dir", "symlink", "deleted", "deleted-deeper"],
)
def test_apply_never_goes_through_a_planted_symlink(
    tmp_path: Path,
    planted: tuple[Path, Path, Tree],
    members: list[tuple[str, str, bytes | str]],
    deleted: list[str],
    opaque: list[str],
) -> None:
    root, outside, before = planted
    diff = _diff_tar(tmp_path / "d.tar", members, deleted=deleted, opaque=opaque)
    first = members[0][0] if members else deleted[0]
    with pytest.raises(RootfsDiffError, match=f"^/{first}: /etc in the target root filesystem is a symlink"):
        apply_diff(diff, root)
    assert _tree(outside) == before


def test_opaque_through_a_planted_symlink_is_refused(
    tmp_path: Path, planted: tuple[Path, Path, Tree]
) -> None:
    root, outside, before = planted
    (outside / "ssl").mkdir()
    (outside / "ssl" / "cert.pem").write_text("cert")
    before = _tree(outside)
    diff = _diff_tar(tmp_path / "d.tar", opaque=["etc/ssl"])
    with pytest.raises(RootfsDiffError, match=r"^/etc/ssl: /etc in the target root filesystem is a symlink"):
        apply_diff(diff, root)
    assert _tree(outside) == before


def test_symlinks_at_the_written_place_are_replaced_not_followed(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    root.mkdir()
    (root / "etc").symlink_to(outside)  # a directory member replaces it
    (root / "profile").symlink_to(outside / "secret")  # a file member replaces it
    (root / "tmpdir").mkdir()  # a symlink member replaces it
    (root / "tmpdir" / "f").write_text("f")
    os.mkfifo(root / "fifo")  # a file member replaces it without blocking on it
    before = _tree(outside)
    diff = _diff_tar(
        tmp_path / "d.tar",
        [
            ("etc", "dir", ""),
            ("etc/secret", "file", b"mine"),
            ("fifo", "file", b"now a file"),
            ("profile", "file", b"export A=1"),
            ("tmpdir", "sym", "/tmp"),
            ("x/y/z", "file", b"deep"),
        ],
    )
    stats = apply_diff(diff, root)
    assert _tree(outside) == before
    tree = _tree(root)
    assert tree["etc"][0] == "dir"
    assert tree["etc/secret"][-1] == b"mine"
    assert tree["profile"][:2] == ("file", 0o640)
    assert tree["profile"][-1] == b"export A=1"
    assert tree["fifo"][-1] == b"now a file"
    assert tree["tmpdir"][:2] == ("link", "/tmp")
    assert tree["x"][:2] == ("dir", 0o755)
    assert tree["x/y/z"][-1] == b"deep"
    assert (stats.files, stats.bytes) == (6, len(b"mine" + b"now a file" + b"export A=1" + b"deep"))


def test_a_format_1_diff_still_applies_with_its_pax_mtimes(tmp_path: Path) -> None:
    """Artifacts taken before the mtimes moved into the header carry them in PAX headers."""
    diff = tmp_path / "d.tar"
    with tarfile.open(diff, "w", format=tarfile.PAX_FORMAT) as tar:
        raw = json.dumps({"format": 1, "deleted": [], "opaque": []}).encode()
        header = tarfile.TarInfo(HEADER_NAME)
        header.size = len(raw)
        tar.addfile(header, io.BytesIO(raw))
        info = tarfile.TarInfo("f.txt")
        info.size, info.mtime, info.uid, info.gid = 2, 1700000000.25, os.getuid(), os.getgid()
        tar.addfile(info, io.BytesIO(b"hi"))
    (tmp_path / "root").mkdir()
    apply_diff(diff, tmp_path / "root")
    assert (tmp_path / "root" / "f.txt").read_bytes() == b"hi"
    assert (tmp_path / "root" / "f.txt").stat().st_mtime_ns == 1_700_000_000_250_000_000


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: _diff_tar(p, [("etc/passwd", "file", b"x")], with_header=False),
            "its first member is 'etc/passwd'",
        ),
        (lambda p: _diff_tar(p, with_header=False), "its first member is nothing"),
        (lambda p: _diff_tar(p, header={"format": 3, "deleted": [], "opaque": []}), "format 3 is unknown"),
        (
            lambda p: _diff_tar(p, header={"format": 2, "mtimes": {"etc/x": 1.5}}),
            "'mtimes' is not a map of paths to nanoseconds",
        ),
        (lambda p: _diff_tar(p, header={"format": 2, "mtimes": {"../x": 1}}), "mtimes path"),
        (lambda p: _diff_tar(p, header={"format": 1, "deleted": "etc"}), "'deleted' is not a list of paths"),
        (lambda p: _diff_tar(p, header={"format": 2, "early": -1}), "'early' is -1, not a count"),
        (lambda p: _diff_tar(p, header={"format": 2, "early": True}), "'early' is True, not a count"),
        (lambda p: _diff_tar(p, header={"format": 2, "early": "3"}), "'early' is '3', not a count"),
        (lambda p: p.write_bytes(b"not a tar at all" * 64) and p, "not a readable rootfs diff tar"),
    ],
    ids=[
        "no-header",
        "empty-tar",
        "unknown-format",
        "bad-mtimes",
        "mtime-out-of-tree",
        "bad-list",
        "negative-early",
        "bool-early",
        "string-early",
        "not-a-tar",
    ],
)
def test_apply_refuses_what_is_not_a_diff(tmp_path: Path, make: Callable[[Path], Path], message: str) -> None:
    diff = tmp_path / "d.tar"
    make(diff)
    (tmp_path / "root").mkdir()
    with pytest.raises(RootfsDiffError, match=f"^{diff}: .*{message}"):
        apply_diff(diff, tmp_path / "root")
    assert list((tmp_path / "root").iterdir()) == []


def test_apply_refuses_a_device_member(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    diff = _diff_tar(tmp_path / "d.tar", [("dev", "dir", ""), ("dev/sda", "chr", "")])
    with pytest.raises(RootfsDiffError, match=r"^/dev/sda: the diff holds a character device; only files"):
        apply_diff(diff, root)
    assert not (root / "dev" / "sda").exists()


def test_a_missing_diff_or_root_is_named(tmp_path: Path) -> None:
    with pytest.raises(RootfsDiffError, match=f"^{tmp_path}/nothing.tar: No such file"):
        apply_diff(tmp_path / "nothing.tar", tmp_path)
    with pytest.raises(RootfsDiffError, match=f"^{tmp_path}/no-upper: No such file"):
        capture_diff(tmp_path / "no-upper", tmp_path / "d.tar")


def _layer(upper: Path) -> Path:
    for d in ("app/cache/k1", "app/cache/k2", "usr/lib"):
        (upper / d).mkdir(parents=True)
    (upper / "app" / "cache" / "k1" / "launcher.so").write_bytes(b"\x7fELF mapped")
    (upper / "app" / "cache" / "k1" / "kernel.ptx").write_text("ptx")
    (upper / "app" / "cache" / "k2" / "kernel.ptx").write_text("ptx 2")
    (upper / "app" / "log.txt").write_text("open for append")
    (upper / "app" / "current").symlink_to("cache/k1")
    (upper / "zz.txt").write_text("last")
    return upper


def test_what_the_tree_holds_is_written_first_and_counted(tmp_path: Path) -> None:
    upper = _layer(tmp_path / "upper")
    held = {"/app/cache/k1/launcher.so", "/app/log.txt", "/usr/lib/libc.so.6", "/app"}
    stats = capture_diff(upper, tmp_path / "d.tar", held=held)
    with tarfile.open(tmp_path / "d.tar") as tar:
        names = tar.getnames()
        header = tar.extractfile(HEADER_NAME)
        assert header is not None
        doc = json.loads(header.read())
    first = [
        "app", "app/cache", "app/cache/k1", "app/cache/k1/launcher.so", "app/cache/k2", "app/current",
        "app/log.txt", "usr", "usr/lib",
    ]  # fmt: skip
    assert names == [HEADER_NAME, *first, "app/cache/k1/kernel.ptx", "app/cache/k2/kernel.ptx", "zz.txt"]
    assert doc["early"] == stats.early == len(first)
    # Without what the tree holds, nothing is told apart: a restore applies it all before CRIU.
    plain = capture_diff(upper, tmp_path / "plain.tar")
    assert plain.early is None
    with tarfile.open(tmp_path / "plain.tar") as tar:
        header = tar.extractfile(HEADER_NAME)
        assert header is not None
        assert "early" not in json.loads(header.read())


def test_the_rest_is_written_apart_and_the_tree_ends_equal(tmp_path: Path) -> None:
    upper = _layer(tmp_path / "upper")
    capture_diff(upper, tmp_path / "d.tar", held={"/app/cache/k1/launcher.so"})
    root = tmp_path / "root"
    root.mkdir()
    applying = DiffApply(tmp_path / "d.tar", root)
    applying.early()
    assert not applying.complete
    assert (root / "app" / "cache" / "k1" / "launcher.so").read_bytes() == b"\x7fELF mapped"
    assert (root / "app" / "current").is_symlink()
    assert (root / "app" / "cache" / "k2").is_dir()
    assert not (root / "app" / "cache" / "k1" / "kernel.ptx").exists()
    assert not (root / "zz.txt").exists()
    stats = applying.rest()
    assert _tree(root) == _tree(upper)
    assert (stats.files, stats.bytes) == (
        12,
        sum(len(f.read_bytes()) for f in upper.rglob("*") if f.is_file() and not f.is_symlink()),
    )
    # The directories' mtimes are set last, once nothing more is written into them.
    assert (root / "app" / "cache" / "k2").stat().st_mtime_ns == (
        upper / "app" / "cache" / "k2"
    ).stat().st_mtime_ns


def test_a_diff_without_the_count_is_written_whole_by_early(tmp_path: Path) -> None:
    upper = _layer(tmp_path / "upper")
    capture_diff(upper, tmp_path / "d.tar")
    root = tmp_path / "root"
    root.mkdir()
    applying = DiffApply(tmp_path / "d.tar", root)
    applying.early()
    assert applying.complete
    assert (root / "zz.txt").read_text() == "last"
    applying.rest()
    assert _tree(root) == _tree(upper)


def test_a_stopped_rest_says_so_and_writes_no_more(tmp_path: Path) -> None:
    upper = _layer(tmp_path / "upper")
    capture_diff(upper, tmp_path / "d.tar", held=set())
    root = tmp_path / "root"
    root.mkdir()
    applying = DiffApply(tmp_path / "d.tar", root)
    applying.early()
    applying.stop.set()
    with pytest.raises(RootfsDiffError, match="applying stopped, the restore having ended"):
        applying.rest()
    assert not (root / "zz.txt").exists()
    applying.close()  # once more: nothing left to close


def test_a_planted_symlink_in_the_rest_is_refused_there(tmp_path: Path) -> None:
    """The restored worker runs while the rest is written: a link it puts where a directory of the
    diff belongs is refused, never followed."""
    upper = _layer(tmp_path / "upper")
    capture_diff(upper, tmp_path / "d.tar", held=set())
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    applying = DiffApply(tmp_path / "d.tar", root)
    applying.early()
    shutil.rmtree(root / "app" / "cache" / "k2")
    (root / "app" / "cache" / "k2").symlink_to(outside)
    with pytest.raises(RootfsDiffError, match="/app/cache/k2 in the target root filesystem is a symlink"):
        applying.rest()
    assert list(outside.iterdir()) == []
