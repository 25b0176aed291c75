"""The streamed layer and its OCI archive: a tar that Python's tarfile reads back member for member, of
the length announced before its first byte, whose digest is the config's diff ID and the manifest's layer
digest; a file that changes size while it is read stops the write."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot_dev.localcluster.host_trees import Tree, merge, walk_tree
from dynamo_snapshot_dev.localcluster.images import (
    ANNOTATION_CONTAINERD_NAME,
    MEDIA_CONFIG,
    MEDIA_MANIFEST,
    ImageBuildError,
    ImageRef,
)
from dynamo_snapshot_dev.localcluster.layer_stream import (
    MEDIA_LAYER_TAR,
    ImageConfig,
    LayerStream,
    header_size,
    tar_header,
    write_oci_file,
)

REF = ImageRef("localhost/test/streamed", "1.0")
CONFIG = ImageConfig(entrypoint=("/app/run",), env=("PATH=/bin",))
LONG = "d" * 60 + "/" + "e" * 70


def _tree(base: Path) -> Path:
    root = base / "tree"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run").write_text("#!/bin/sh\necho run\n")
    (root / "bin" / "run").chmod(0o755)
    (root / "bin" / "alias").symlink_to("run")
    (root / "bin" / "far").symlink_to("/" + "t" * 120)  # a link target past the 100-byte field
    (root / LONG).parent.mkdir(parents=True)
    (root / LONG).write_bytes(b"x" * 1000)
    (root / "empty").write_bytes(b"")
    (root / "block").write_bytes(os.urandom(3 * 512))
    (root / "big").write_bytes(os.urandom((1 << 20) + 17))  # more than one buffer
    os.link(root / "block", root / "block-again")
    os.utime(root / "bin" / "run", (1_700_000_000, 1_700_000_000))
    return root


def _read_tar(path: Path, offset: int = 0) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
    with path.open("rb") as fh:
        fh.seek(offset)
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            out = {}
            for m in tar.getmembers():
                f = tar.extractfile(m) if m.isfile() else None
                out[m.name] = (m, f.read() if f else b"")
            return out


@pytest.mark.parametrize(
    ("name", "kind", "link", "size"),
    [
        ("a/b", "file", "", 5),
        ("x" * 100, "file", "", 0),
        ("x" * 101, "dir", "", 0),
        ("x" * 600, "file", "", 12),
        ("l", "link", "y" * 300, 0),
        ("huge", "file", "", 9 * 2**30),  # past the 8 GiB that 11 octal digits hold
    ],
)
def test_header_is_read_back_by_tarfile(tmp_path: Path, name: str, kind: str, link: str, size: int) -> None:
    head = tar_header(name, kind, mode=0o4755, uid=1000, gid=7, size=size, mtime=1_700_000_123, link=link)
    assert len(head) == header_size(name, kind, link)
    blob = tmp_path / "one.tar"
    data = b"z" * min(size, 64)
    blob.write_bytes(head + data + b"\0" * (-len(data) % 512) + b"\0" * 1024)
    with tarfile.open(blob, mode="r:") as tar:
        info = tar.next()
    assert info is not None
    assert info.name == name
    assert (info.size, info.mode, info.uid, info.gid, info.mtime) == (size, 0o4755, 1000, 7, 1_700_000_123)
    assert info.isdir() == (kind == "dir")
    assert info.linkname == link


def test_layer_holds_the_tree_as_it_is(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    files = merge(walk_tree(Tree(root)))
    layer = LayerStream(files)
    out = tmp_path / "layer.tar"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        stats = layer.write(fd)
    finally:
        os.close(fd)
    raw = out.read_bytes()
    assert stats.size == layer.size == len(raw)
    assert stats.digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    members = _read_tar(out)
    prefix = str(root).lstrip("/")
    rel = {name.removeprefix(prefix).lstrip("/"): v for name, v in members.items()}
    assert rel[f"{LONG}"][1] == b"x" * 1000
    assert rel["big"][1] == (root / "big").read_bytes()
    assert rel["empty"][1] == b""
    run, data = rel["bin/run"]
    assert (data, run.mode, run.mtime) == (b"#!/bin/sh\necho run\n", 0o755, 1_700_000_000)
    assert rel["bin/alias"][0].issym()
    assert rel["bin/alias"][0].linkname == "run"
    assert rel["bin/far"][0].linkname == "/" + "t" * 120
    # The second name of a file is a hard link to the first (sorted) name, its bytes stored once.
    assert rel["block"][1] == (root / "block").read_bytes()
    assert rel["block-again"][0].islnk()
    assert rel["block-again"][0].linkname == f"{prefix}/block"
    # A directory comes before what it holds.
    names = list(members)
    assert names.index(f"{prefix}/bin") < names.index(f"{prefix}/bin/run")


def test_a_file_that_changes_while_streamed_stops_the_write(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    layer = LayerStream(merge(walk_tree(Tree(root))))
    (root / "block").write_bytes(b"shorter")
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        with pytest.raises(ImageBuildError, match="changed while the image was built"):
            layer.write(fd)
        (root / "block").unlink()
        with pytest.raises(ImageBuildError, match="cannot be read"):
            layer.write(fd)
    finally:
        os.close(fd)


def _blob(members: dict[str, tuple[tarfile.TarInfo, bytes]], digest: str) -> bytes:
    data = members["blobs/" + digest.replace(":", "/")][1]
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def test_oci_file_is_a_layout_with_an_uncompressed_layer(tmp_path: Path) -> None:
    layer = LayerStream(merge(walk_tree(Tree(_tree(tmp_path)))))
    out = tmp_path / "image.tar"
    stats = write_oci_file(out, layer, REF, CONFIG)
    members = _read_tar(out)
    assert json.loads(members["oci-layout"][1]) == {"imageLayoutVersion": "1.0.0"}
    (desc,) = json.loads(members["index.json"][1])["manifests"]
    assert desc["mediaType"] == MEDIA_MANIFEST
    assert desc["annotations"][ANNOTATION_CONTAINERD_NAME] == REF.name
    manifest: dict[str, Any] = json.loads(_blob(members, desc["digest"]))
    assert manifest["config"]["mediaType"] == MEDIA_CONFIG
    config = json.loads(_blob(members, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/app/run"]
    assert config["config"]["Env"] == ["PATH=/bin"]
    (layer_desc,) = manifest["layers"]
    assert layer_desc["mediaType"] == MEDIA_LAYER_TAR
    # Uncompressed: the layer's digest is its diff ID, and its blob is the tar the stream hashed.
    assert layer_desc["digest"] == stats.digest == config["rootfs"]["diff_ids"][0]
    blob = _blob(members, layer_desc["digest"])
    assert len(blob) == layer_desc["size"] == layer.size
    assert blob[257:263] == b"ustar "  # a tar, not gzip
    # Written again, the same files make the same archive: nothing in it depends on the moment.
    again = tmp_path / "again.tar"
    write_oci_file(again, layer, REF, CONFIG)
    assert again.read_bytes() == out.read_bytes()
