"""The OCI archive writer: a layout `ctr images import` accepts, with digests that match the bytes."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.localcluster.images import (
    ANNOTATION_CONTAINERD_NAME,
    ANNOTATION_REF_NAME,
    ImageBuildError,
    ImageRef,
    write_oci_archive,
)

REF = ImageRef("localhost/test/app", "1.0")


def _rootfs(base: Path) -> Path:
    root = base / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "app").write_text("#!/bin/sh\necho hi\n")
    (root / "bin" / "app").chmod(0o755)
    (root / "bin" / "alias").symlink_to("app")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    return root


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _blob(members: dict[str, bytes], digest: str) -> bytes:
    data = members[f"blobs/sha256/{digest.removeprefix('sha256:')}"]
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def test_archive_is_a_valid_oci_layout(tmp_path: Path) -> None:
    out = write_oci_archive(tmp_path / "img.tar", _rootfs(tmp_path), REF, entrypoint=["/bin/app"], cmd=["x"])
    members = _members(out)
    assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(members["index.json"])
    (desc,) = index["manifests"]
    assert desc["annotations"] == {
        ANNOTATION_CONTAINERD_NAME: "localhost/test/app:1.0",
        ANNOTATION_REF_NAME: "1.0",
    }
    assert desc["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest: dict[str, Any] = json.loads(_blob(members, desc["digest"]))
    assert len(_blob(members, desc["digest"])) == desc["size"]
    config = json.loads(_blob(members, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/bin/app"]
    assert config["config"]["Cmd"] == ["x"]
    (layer_desc,) = manifest["layers"]
    layer_gz = _blob(members, layer_desc["digest"])
    layer = gzip.decompress(layer_gz)
    # diff_id is the digest of the uncompressed layer, which is what containerd checks after unpacking.
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        entries = {m.name: m for m in tar.getmembers()}
    assert set(entries) == {"bin", "bin/app", "bin/alias", "etc", "etc/passwd"}
    assert entries["bin/alias"].issym()
    assert entries["bin/alias"].linkname == "app"
    assert entries["bin/app"].mode & 0o777 == 0o755
    assert all(m.uid == 0 and m.gid == 0 and m.mtime == 0 for m in entries.values())


def test_same_tree_gives_the_same_digests(tmp_path: Path) -> None:
    root = _rootfs(tmp_path)
    a = write_oci_archive(tmp_path / "a.tar", root, REF, entrypoint=["/bin/app"])
    (root / "etc" / "passwd").touch()  # a new mtime alone must not change the image
    b = write_oci_archive(tmp_path / "b.tar", root, REF, entrypoint=["/bin/app"])
    assert json.loads(_members(a)["index.json"]) == json.loads(_members(b)["index.json"])
    (root / "etc" / "passwd").write_text("changed\n")
    c = write_oci_archive(tmp_path / "c.tar", root, REF, entrypoint=["/bin/app"])
    assert json.loads(_members(a)["index.json"]) != json.loads(_members(c)["index.json"])


def test_missing_rootfs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="is not a directory"):
        write_oci_archive(tmp_path / "x.tar", tmp_path / "nope", REF, entrypoint=["/x"])
