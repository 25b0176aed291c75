"""Large-block parallel I/O: correctness at every size boundary, O_DIRECT and its fallback."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from dynamo_snapshot.fileio import acopy_tree, asha256_file, copy_file, copy_tree, sha256_file
from tests.artifact.helpers import refuse_direct_reads

MIB = 1 << 20
SMALL_BLOCK = 64 * 1024


def write_pattern(path: Path, size: int) -> str:
    """A file whose every MiB differs (so a block written at the wrong offset shows); its sha256."""
    seed = os.urandom(MIB)
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for i in range(0, size, MIB):
            chunk = (i.to_bytes(8, "little") + seed[8:])[: min(MIB, size - i)]
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def test_copy_256mib_with_checksum_and_throughput(tmp_path: Path) -> None:
    src, dst = tmp_path / "pages-1.img", tmp_path / "copy" / "pages-1.img"
    dst.parent.mkdir()
    size = 256 * MIB + 12345  # a ragged tail exercises the O_DIRECT padding and truncate
    expected = write_pattern(src, size)
    copied = copy_file(src, dst, sha256=True)
    assert copied.bytes == size
    assert copied.sha256 == expected
    assert dst.stat().st_size == size
    hashed = sha256_file(dst)
    assert hashed.sha256 == expected
    assert hashed.bytes == size
    assert copied.gbps > 0
    assert hashed.gbps > 0
    print(
        f"\ncopy 256 MiB: {copied.gbps:.2f} GB/s (O_DIRECT {copied.direct}); sha256: {hashed.gbps:.2f} GB/s"
    )


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, SMALL_BLOCK - 1, SMALL_BLOCK, 5 * SMALL_BLOCK + 7])
@pytest.mark.parametrize("direct", [True, False])
def test_sizes_at_block_boundaries(tmp_path: Path, size: int, direct: bool) -> None:
    data = os.urandom(size)
    (tmp_path / "src").write_bytes(data)
    copied = copy_file(
        tmp_path / "src", tmp_path / "dst", direct=direct, sha256=True, block_size=SMALL_BLOCK, inflight=3
    )
    assert (tmp_path / "dst").read_bytes() == data
    assert copied.sha256 == hashlib.sha256(data).hexdigest()
    hashed = sha256_file(tmp_path / "src", direct=direct, block_size=SMALL_BLOCK, inflight=2)
    assert (hashed.sha256, hashed.bytes) == (copied.sha256, size)


def test_copy_replaces_longer_destination(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"short")
    (tmp_path / "dst").write_bytes(b"x" * 100000)
    copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == b"short"


def test_tmpfs(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    work = shm / f"dynsnap-io-{os.getpid()}"
    work.mkdir()
    try:
        expected = write_pattern(work / "src", 8 * MIB + 3)
        copied = copy_file(work / "src", work / "dst", sha256=True, block_size=MIB)
        assert copied.sha256 == expected
        assert sha256_file(work / "dst", direct=True).sha256 == expected
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


def test_fallback_when_open_refuses_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What tmpfs did before Linux 6.6 and what some FUSE and network filesystems still do.
    real_open = os.open

    def no_direct(path: object, flags: int, *args: int, **kwargs: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    expected = write_pattern(tmp_path / "src", 3 * MIB + 1)
    copied = copy_file(tmp_path / "src", tmp_path / "dst", sha256=True, block_size=MIB)
    assert copied.direct is False
    assert copied.sha256 == expected
    hashed = sha256_file(tmp_path / "dst", direct=True)
    assert (hashed.direct, hashed.sha256) == (False, expected)


def test_fallback_when_reads_refuse_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Accepted at open, refused per request: the copy starts over buffered.
    refuse_direct_reads(monkeypatch)
    expected = write_pattern(tmp_path / "src", 3 * MIB + 1)
    copied = copy_file(tmp_path / "src", tmp_path / "dst", sha256=True, block_size=MIB)
    assert copied.direct is False
    assert copied.sha256 == expected
    assert sha256_file(tmp_path / "dst", direct=True).sha256 == expected


def test_other_errors_are_not_swallowed(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        copy_file(tmp_path / "missing", tmp_path / "dst")
    (tmp_path / "src").write_bytes(b"x")
    with pytest.raises(ValueError, match="multiple of 4096"):
        copy_file(tmp_path / "src", tmp_path / "dst", block_size=1000)


def make_tree(root: Path) -> dict[str, bytes]:
    files = {"a.img": os.urandom(300000), "sub/b.img": os.urandom(10), "sub/deeper/c.img": b"", "d": b"d"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_copy_tree(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src")
    stats = copy_tree(tmp_path / "src", tmp_path / "dst", sha256=True, block_size=SMALL_BLOCK)
    assert sorted(stats.files) == sorted(files)
    assert stats.bytes == sum(len(d) for d in files.values())
    for rel, data in files.items():
        assert (tmp_path / "dst" / rel).read_bytes() == data
        assert stats.files[rel].sha256 == hashlib.sha256(data).hexdigest()


def test_copy_tree_subset_and_refusals(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    stats = copy_tree(tmp_path / "src", tmp_path / "dst", files=["sub/b.img"])
    assert list(stats.files) == ["sub/b.img"]
    assert sorted(p.name for p in (tmp_path / "dst").rglob("*") if p.is_file()) == ["b.img"]
    for bad in ("../x", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="not a relative path inside the tree"):
            copy_tree(tmp_path / "src", tmp_path / "dst2", files=[bad])
    (tmp_path / "src" / "link").symlink_to(tmp_path / "src" / "a.img")
    with pytest.raises(ValueError, match="not a regular file"):
        copy_tree(tmp_path / "src", tmp_path / "dst3")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"s")
    (tmp_path / "src" / "linkdir").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="not a regular file inside"):
        copy_tree(tmp_path / "src", tmp_path / "dst4", files=["linkdir/secret"])


async def test_async_wrappers(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src")
    stats = await acopy_tree(tmp_path / "src", tmp_path / "dst", sha256=True)
    assert stats.bytes == sum(len(d) for d in files.values())
    hashed = await asha256_file(tmp_path / "dst" / "a.img")
    assert hashed.sha256 == hashlib.sha256(files["a.img"]).hexdigest()
