"""The OCI archive writer: a layout `ctr images import` accepts, with digests that match the bytes; the
CPU reference worker image: complete enough to import the SDK under chroot and on the real node."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.distributions import SDK_PYPROJECT
from dynamo_snapshot_dev.localcluster.images import (
    ANNOTATION_CONTAINERD_NAME,
    ANNOTATION_REF_NAME,
    WORKER_ENTRYPOINT,
    WORKER_ENV,
    WORKER_PYTHON,
    WORKER_REPOSITORY,
    WORKER_SCRIPT,
    ImageBuildError,
    ImageRef,
    build_worker_rootfs,
    project_root,
    worker_image,
    worker_image_archive,
    write_oci_archive,
)
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from tests.helpers.polling import wait_for

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


# ---------------------------------------------------------------------------------------- the worker image


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A frozen copy of the sources the worker image takes: others may edit the checkout meanwhile."""
    src = project_root()
    dst = tmp_path / "repo"
    shutil.copytree(
        src / "dynamo_snapshot", dst / "dynamo_snapshot", ignore=shutil.ignore_patterns("__pycache__")
    )
    # The SDK's pyproject names the files a worker image takes.
    (dst / SDK_PYPROJECT).parent.mkdir(parents=True)
    shutil.copy2(src / SDK_PYPROJECT, dst / SDK_PYPROJECT)
    (dst / WORKER_SCRIPT).parent.mkdir(parents=True)
    shutil.copy2(src / WORKER_SCRIPT, dst / WORKER_SCRIPT)
    return dst


def _chroot() -> str:
    chroot = shutil.which("chroot")
    assert chroot is not None, "chroot (coreutils) is missing"
    return chroot


def _chroot_python(rootfs: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by the image's interpreter with the image's environment, nothing of this process's."""
    env = dict(item.split("=", 1) for item in WORKER_ENV)
    return subprocess.run(
        [_chroot(), str(rootfs), str(WORKER_PYTHON), "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_worker_rootfs_imports_the_sdk_under_chroot(tmp_path: Path, repo: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chroot needs root: re-run with sudo")
    rootfs = tmp_path / "rootfs"
    image = build_worker_rootfs(rootfs, repo)
    assert image == worker_image(repo)
    assert image.repository == WORKER_REPOSITORY
    # Debian's interpreter, whose libraries are the ones ldd found and the image carries.
    assert (rootfs / "usr/bin/python3.11").read_bytes() == WORKER_PYTHON.read_bytes()

    proc = _chroot_python(
        rootfs,
        "import sys, dynamo_snapshot.workload, cpu_worker; "
        "print('ok', sys.prefix, dynamo_snapshot.workload.__file__, cpu_worker.__file__)",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "ok",
        "/usr",
        "/app/dynamo_snapshot/workload/__init__.py",
        "/app/cpu_worker.py",
    ]
    # The SDK needs no site-packages: the image carries none, and the product's modules are not there.
    assert not (rootfs / "usr/lib/python3/dist-packages").exists()
    assert not (rootfs / "app/dynamo_snapshot/controller").exists()
    # The extension modules the worker and its SDK use load with the libraries the image carries.
    proc = _chroot_python(
        rootfs, "import ctypes, hashlib, ssl, lzma, bz2, zlib, json, mmap, uuid; print('ext-ok')"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ext-ok"
    sh = subprocess.run(
        [_chroot(), str(rootfs), "/bin/sh", "-c", "echo sh-ok; ls /tmp"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert sh.stdout.strip() == "sh-ok", sh.stderr

    stdlib = rootfs / "usr/lib/python3.11"
    for dropped in ("test", "lib2to3", "ensurepip", "config-3.11-x86_64-linux-gnu"):
        assert not (stdlib / dropped).exists(), dropped
    # The image's own bytecode, compiled at build time: hash-based and never checked against the
    # sources (flags 0b01 in the header), so the layer is the same on every build; none from this host.
    for pyc in (
        rootfs / "app/dynamo_snapshot/workload/__pycache__/standby.cpython-311.pyc",
        stdlib / "json/__pycache__/__init__.cpython-311.pyc",
    ):
        assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01, pyc
    assert (rootfs / "tmp").stat().st_mode & 0o7777 == 0o1777


def test_worker_archive_is_reproducible_and_cached(tmp_path: Path, repo: Path) -> None:
    stale = tmp_path / "a" / "images" / "worker-000000000000.tar"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an archive of sources that are gone")
    image_a, archive_a = worker_image_archive(repo, cache=tmp_path / "a")
    image_b, archive_b = worker_image_archive(repo, cache=tmp_path / "b")
    assert image_a == image_b == worker_image(repo)
    assert archive_a == tmp_path / "a" / "images" / f"worker-{image_a.tag}.tar"
    assert not stale.exists()
    # Two builds of the same inputs: the same manifest digest, so containerd sees the same image.
    members_a, members_b = _members(archive_a), _members(archive_b)
    assert members_a["index.json"] == members_b["index.json"]
    (desc,) = json.loads(members_a["index.json"])["manifests"]
    assert desc["annotations"][ANNOTATION_CONTAINERD_NAME] == image_a.name
    manifest = json.loads(_blob(members_a, desc["digest"]))
    config = json.loads(_blob(members_a, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == list(WORKER_ENTRYPOINT)
    assert config["config"]["Env"] == list(WORKER_ENV)

    before = archive_a.stat()
    again, archive = worker_image_archive(repo, cache=tmp_path / "a")
    assert (again, archive) == (image_a, archive_a)
    after = archive.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), (
        "the cached one was rebuilt"
    )


def test_worker_tag_follows_the_sdk_sources(repo: Path) -> None:
    first = worker_image(repo)
    assert worker_image(repo) == first
    handshake = repo / "dynamo_snapshot" / "workload" / "handshake.py"
    handshake.write_text(handshake.read_text() + "\n# a change\n")
    assert worker_image(repo).tag != first.tag


def test_worker_image_outside_a_checkout_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="is not a dynamo-snapshot source checkout"):
        worker_image(tmp_path)


def _worker_pod(node: RealNode, name: str, container: dict[str, Any]) -> dict[str, Any]:
    main = {"name": "worker", "image": node.worker_image.name, "imagePullPolicy": "Never", **container}
    return node.pod(name, [main], restartPolicy="Never")


@pytest.mark.cluster
@pytest.mark.kubelet
def test_worker_image_imports_the_sdk_on_the_real_node(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    code = "import dynamo_snapshot.workload; print('sdk-ok')"
    cluster.apply(
        _worker_pod(real_node, "sdk", {"command": [str(WORKER_PYTHON), "-c", code]}), namespace=namespace
    )

    def finished() -> str:
        out = cluster.kubectl("get", "-n", namespace, "pod", "sdk", "-o", "jsonpath={.status.phase}").stdout
        return out if out in ("Succeeded", "Failed") else ""

    phase = wait_for(finished, within=90, what="the sdk pod to finish")
    logs = cluster.kubectl("logs", "-n", namespace, "sdk").stdout
    assert (phase, logs.strip()) == ("Succeeded", "sdk-ok"), logs


@pytest.mark.cluster
@pytest.mark.kubelet
def test_worker_image_entrypoint_serves_the_cpu_worker(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    """The image's own entrypoint starts the worker; busybox answers the exec probe and `kubectl exec`."""
    health = ["wget", "-qO-", "http://127.0.0.1:8000/health"]
    container = {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "WORKER_PORT", "value": "8000"},
            {"name": "WORKER_WEIGHTS_MIB", "value": "1"},
            {"name": "WORKER_COMPILE_ROUNDS", "value": "1000"},
        ],
        "readinessProbe": {"exec": {"command": health}, "periodSeconds": 1},
    }
    cluster.apply(_worker_pod(real_node, "entry", container), namespace=namespace)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", "pod/entry", "--timeout=90s", timeout=100
    )
    answer = json.loads(cluster.kubectl("exec", "-n", namespace, "entry", "--", *health).stdout)
    assert answer["pod"] == "entry"
    assert "serving on 127.0.0.1:8000 as entry" in cluster.kubectl("logs", "-n", namespace, "entry").stdout
