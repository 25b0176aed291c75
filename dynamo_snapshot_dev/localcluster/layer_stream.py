"""An uncompressed image layer written once, straight from the host's files into `ctr images import`.

A worker image of gigabytes cannot afford what `images.write_oci_archive` does for the small images (the
layer built in memory, gzip'd, then copied into the archive): gzip alone runs at tens of MB/s. Here the
layer is a plain tar (`application/vnd.oci.image.layer.v1.tar`) whose size is known before its first byte
(headers are computed from the files' metadata), so the OCI archive around it can be written as one
stream: `oci-layout`, the layer's tar header and the layer itself (each file read once and hashed as it
is written: its digest is the layer's digest and the config's diff ID), then the config, the manifest
and `index.json`, which need that digest. containerd's importer names every blob by the digest of its
bytes, not by its name in the archive, and reads `index.json` wherever it comes, so the layer goes in
under a name chosen before its digest is known (`LAYER_PLACEHOLDER`). Written to a file instead
(`write_oci_file`), the layer's header is rewritten afterwards with its digest, which makes the file a
regular OCI image layout.

The tar is GNU format (long names and link targets in `L`/`K` records, sizes of 8 GiB and over in
base-256), with the files' own modes, owners and modification times (the bytecode next to a module is
checked against its source's time); files with several names are stored once, the later names as hard
links. A file whose size changed since it was selected stops the write with an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot_dev.localcluster.host_trees import HostFile
from dynamo_snapshot_dev.localcluster.images import ImageBuildError, ImageRef, oci_manifest_and_index

MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
BLOCK = 512
NAME_MAX = 100
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
LAYER_PLACEHOLDER = "blobs/sha256/layer"
CHUNK = 1 << 20
PREFETCH_THREADS = 8
PREFETCH_LEAD = 1 << 30
_TYPEFLAGS = {"file": b"0", "hardlink": b"1", "link": b"2", "dir": b"5"}
_LONG_NAME = b"././@LongLink"


def _number(value: int, width: int) -> bytes:
    """A header number field: octal digits and a NUL, or GNU base-256 where octal does not fit."""
    if value < 8 ** (width - 1):
        return b"%0*o\0" % (width - 1, value)
    return b"\x80" + value.to_bytes(width - 1, "big")


def _padding(size: int) -> int:
    return -size % BLOCK


def _long_record(kind: bytes, value: bytes) -> bytes:
    data = value + b"\0"
    return _header(_LONG_NAME, kind, 0, 0, 0, len(data), 0) + data + b"\0" * _padding(len(data))


def _header(name: bytes, typeflag: bytes, mode: int, uid: int, gid: int, size: int, mtime: int,
            link: bytes = b"") -> bytes:  # fmt: skip
    fields = (
        name.ljust(NAME_MAX, b"\0"), _number(mode, 8), _number(uid, 8), _number(gid, 8), _number(size, 12),
        _number(mtime, 12), b" " * 8, typeflag, link.ljust(NAME_MAX, b"\0"), b"ustar  \0",
    )  # fmt: skip
    head = b"".join(fields)
    head += b"\0" * (BLOCK - len(head))
    return head[:148] + b"%06o\0 " % _byte_sum(head) + head[156:]


def _byte_sum(data: bytes) -> int:
    """sum(data) for a 512-byte header, in C: Adler-32's low half is 1 + the bytes' sum modulo 65521,
    and no 256 bytes sum to more than 65280."""
    return sum((zlib.adler32(data[i : i + 256]) & 0xFFFF) - 1 for i in range(0, len(data), 256))


def tar_header(name: str, kind: str, *, mode: int, uid: int = 0, gid: int = 0, size: int = 0,
               mtime: int = 0, link: str = "") -> bytes:  # fmt: skip
    """The GNU tar header of one member (with its long-name and long-link records where needed)."""
    raw = (name + "/" if kind == "dir" else name).encode("utf-8", "surrogateescape")
    target = link.encode("utf-8", "surrogateescape")
    out = b""
    if len(raw) > NAME_MAX:
        out += _long_record(b"L", raw)
    if len(target) > NAME_MAX:
        out += _long_record(b"K", target)
    return out + _header(raw[:NAME_MAX], _TYPEFLAGS[kind], mode, uid, gid, size, mtime, target[:NAME_MAX])


def header_size(name: str, kind: str, link: str = "") -> int:
    """len(tar_header(...)) without building it."""
    n = len((name + "/" if kind == "dir" else name).encode("utf-8", "surrogateescape"))
    t = len(link.encode("utf-8", "surrogateescape"))
    size = BLOCK
    for length in (n, t):
        if length > NAME_MAX:
            size += BLOCK + length + 1 + _padding(length + 1)
    return size


@dataclass
class StreamStats:
    """What one write of a layer did: its digest (`sha256:...`), bytes, members and seconds."""

    digest: str = ""
    size: int = 0
    members: int = 0
    seconds: float = 0.0


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class LayerStream:
    """The tar of `files` (sorted image paths, directories before their contents), written on demand."""

    def __init__(self, files: Sequence[HostFile]) -> None:
        self.files = list(files)
        self._links: dict[str, str] = {}
        first: dict[tuple[int, int], str] = {}
        for f in self.files:
            if f.kind == "file" and f.inode is not None:
                self._links[f.path] = first.setdefault(f.inode, f.path)
        self.size = len(END_OF_ARCHIVE) + sum(self._member_size(f) for f in self.files)

    def _kind(self, f: HostFile) -> str:
        return "hardlink" if self._links.get(f.path, f.path) != f.path else f.kind

    def _member_size(self, f: HostFile) -> int:
        kind = self._kind(f)
        link = self._links[f.path] if kind == "hardlink" else f.link
        data = f.size + _padding(f.size) if kind == "file" else 0
        return header_size(f.path, kind, link) + data

    def write(
        self, fd: int, progress: Callable[[int], None] | None = None, prefetch: bool = True
    ) -> StreamStats:
        """Write the layer to `fd`, hashing it; `progress` is told the bytes written so far. With
        `prefetch`, a few threads ask the kernel to read the files ahead of the writer."""
        started = time.monotonic()
        out = _HashingWriter(fd)
        buf = bytearray(CHUNK)
        ahead = _Prefetcher(self.files) if prefetch else None
        try:
            for f in self.files:
                kind = self._kind(f)
                link = self._links[f.path] if kind == "hardlink" else f.link
                size = f.size if kind == "file" else 0
                mtime = f.mtime_ns // 1_000_000_000
                head = tar_header(
                    f.path, kind, mode=f.mode, uid=f.uid, gid=f.gid, size=size, mtime=mtime, link=link
                )
                if kind != "file":
                    out.write(head)
                    continue
                _copy(f, head, out, buf)
                if ahead is not None:
                    ahead.passed(size)
                if progress is not None and size >= CHUNK:
                    progress(out.written)
        finally:
            if ahead is not None:
                ahead.stop()
        out.write(END_OF_ARCHIVE)
        if out.written != self.size:
            raise ImageBuildError(f"the layer came out {out.written} bytes long, {self.size} were announced")
        return StreamStats(out.digest(), out.written, len(self.files), time.monotonic() - started)


class _Prefetcher:
    """Threads that ask the kernel to read the layer's files (`posix_fadvise(WILLNEED)`), in the writer's
    order and at most `PREFETCH_LEAD` bytes ahead of it: on a fresh machine the files are on disk, and a
    single reader that waits for each small file in turn is bound by the disk's latency, not its
    bandwidth."""

    def __init__(self, files: Sequence[HostFile], threads: int = PREFETCH_THREADS) -> None:
        self._files = [f for f in files if f.kind == "file" and f.size]
        self._starts: list[int] = []
        total = 0
        for f in self._files:
            self._starts.append(total)
            total += f.size
        self._next = 0
        self._passed = 0
        self._stopped = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def passed(self, size: int) -> None:
        """The writer is `size` bytes further."""
        with self._cond:
            self._passed += size
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _take(self) -> HostFile | None:
        with self._cond:
            while True:
                if self._stopped or self._next >= len(self._files):
                    return None
                if self._starts[self._next] <= self._passed + PREFETCH_LEAD:
                    self._next += 1
                    return self._files[self._next - 1]
                self._cond.wait()

    def _run(self) -> None:
        while (f := self._take()) is not None:
            try:
                fd = os.open(f.source, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # the writer says what is wrong with it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


class _HashingWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self._hash = hashlib.sha256()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        _write_all(self.fd, data)
        self.written += len(data)

    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


def _copy(f: HostFile, head: bytes, out: _HashingWriter, buf: bytearray) -> None:
    """`head`, then the file's bytes and padding; a file that fits the buffer goes out in one write."""
    view = memoryview(buf)
    try:
        src = os.open(f.source, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ImageBuildError(f"{f.source} cannot be read ({e.strerror}): build the image again") from None
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            raise ImageBuildError(
                f"{f.source} changed while the image was built (size {f.size} -> {st.st_size}): "
                "build it again once nothing writes there"
            )
        pad = _padding(f.size)
        if len(head) + f.size + pad <= CHUNK:
            # Small files (most of an environment): header, data and padding in one hash update and write.
            view[: len(head)] = head
            end = len(head) + _read_exactly(src, view[len(head) : len(head) + f.size], f)
            view[end : end + pad] = bytes(pad)
            out.write(view[: end + pad])
            return
        out.write(head)
        left = f.size
        while left:
            n = _read_exactly(src, view[: min(left, CHUNK)], f)
            out.write(view[:n])
            left -= n
        if pad:
            out.write(bytes(pad))
    finally:
        os.close(src)


def _read_exactly(src: int, view: memoryview, f: HostFile) -> int:
    done = 0
    while done < len(view):
        n = os.readv(src, [view[done:]])
        if n == 0:
            raise ImageBuildError(f"{f.source} shrank while the image was built: build it again")
        done += n
    return done


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of the image config: what a container of it runs, with which environment."""

    entrypoint: tuple[str, ...]
    env: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    working_dir: str = "/"

    def describe(self) -> bytes:
        return json.dumps([self.entrypoint, self.env, self.cmd, self.working_dir]).encode()


def image_documents(image: ImageRef, config: ImageConfig, layer: StreamStats) -> dict[str, bytes]:
    """config, manifest and index.json of a one-layer image whose uncompressed layer is `layer`."""
    config_doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(config.entrypoint),
            "Cmd": list(config.cmd),
            "Env": list(config.env),
            "WorkingDir": config.working_dir,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
    }
    config_bytes = json.dumps(config_doc, sort_keys=True).encode()
    layer_ref = {"mediaType": MEDIA_LAYER_TAR, "digest": layer.digest, "size": layer.size}
    manifest_bytes, index = oci_manifest_and_index(config_bytes, layer_ref, [image])
    return {"config": config_bytes, "manifest": manifest_bytes, "index": index}


def _small_member_bytes(name: str, data: bytes) -> bytes:
    return tar_header(name, "file", mode=0o644, size=len(data)) + data + b"\0" * _padding(len(data))


_OCI_LAYOUT = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
# Where the layer's header starts in the archive: after the oci-layout member.
_OCI_LAYOUT_MEMBER = len(_small_member_bytes("oci-layout", _OCI_LAYOUT))


def _small_member(fd: int, name: str, data: bytes) -> None:
    _write_all(fd, _small_member_bytes(name, data))


def write_oci_stream(
    fd: int,
    layer: LayerStream,
    image: ImageRef,
    config: ImageConfig,
    progress: Callable[[int], None] | None = None,
) -> StreamStats:
    """The OCI archive of the one-layer image, written to `fd` in one pass (see the module's doc)."""
    _small_member(fd, "oci-layout", _OCI_LAYOUT)
    _write_all(fd, tar_header(LAYER_PLACEHOLDER, "file", mode=0o644, size=layer.size))
    stats = layer.write(fd, progress)
    _write_all(fd, b"\0" * _padding(layer.size))
    docs = image_documents(image, config, stats)
    for key in ("config", "manifest"):
        _small_member(fd, "blobs/" + _sha256(docs[key]).replace(":", "/"), docs[key])
    _small_member(fd, "index.json", docs["index"])
    _write_all(fd, END_OF_ARCHIVE)
    return stats


def write_oci_file(out: Path, layer: LayerStream, image: ImageRef, config: ImageConfig) -> StreamStats:
    """The same archive in a file, the layer's header rewritten with its digest (a regular OCI layout)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        stats = write_oci_stream(fd, layer, image, config)
        placeholder = tar_header(LAYER_PLACEHOLDER, "file", mode=0o644, size=layer.size)
        named = tar_header("blobs/" + stats.digest.replace(":", "/"), "file", mode=0o644, size=layer.size)
        if len(named) != len(placeholder):
            raise ImageBuildError("the layer's name does not fit its placeholder's header")
        os.pwrite(fd, named, _OCI_LAYOUT_MEMBER)
    finally:
        os.close(fd)
    return stats
