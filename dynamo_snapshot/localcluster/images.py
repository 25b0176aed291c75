"""Container images for the real node, built on this machine: no registry is reachable here.

`write_oci_archive` turns a root filesystem directory into an OCI image layout tarball (one gzip'd layer)
that `ctr images import` accepts; `build_pause_rootfs` and `build_busybox_rootfs` make the two images the
real node needs: the pod sandbox ("pause") and a small test image with busybox's sh, httpd, sleep, ...
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

# Standard OCI / containerd annotation keys: containerd names the imported image after the first.
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"

BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = (
    "sh", "ls", "cat", "echo", "sleep", "httpd", "wget", "nc", "ps", "kill", "mkdir", "rm", "env", "true",
    "false", "id", "hostname", "date", "seq", "grep", "head", "tail", "touch", "wc", "printf", "test",
)  # fmt: skip

# The pod sandbox only has to hold the namespaces: exit on SIGINT/SIGTERM, reap children, sleep otherwise.
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


class ImageBuildError(RuntimeError):
    """A local image could not be built; the message names the missing tool or file."""


@dataclass(frozen=True)
class ImageRef:
    """`localhost/<repo>:<tag>` as containerd names it after the import."""

    repository: str
    tag: str

    @property
    def name(self) -> str:
        return f"{self.repository}:{self.tag}"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer_tar(rootfs: Path) -> bytes:
    """A reproducible tar of `rootfs`: sorted, root-owned, mtime 0, so equal trees give equal digests."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = Path(dirpath) / name
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                if info.isfile():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def write_oci_archive(
    out: Path,
    rootfs: Path,
    image: ImageRef,
    *,
    entrypoint: Sequence[str],
    cmd: Sequence[str] = (),
    env: Sequence[str] = ("PATH=/bin:/usr/bin:/sbin:/usr/sbin",),
) -> Path:
    """Write an OCI image layout tarball of `rootfs` (one layer) named `image` for `ctr images import`."""
    if not rootfs.is_dir():
        raise ImageBuildError(f"image root filesystem {rootfs} is not a directory")
    layer = _layer_tar(rootfs)
    # mtime=0: the compressed blob, too, depends only on the tree.
    layer_gz = gzip.compress(layer, compresslevel=6, mtime=0)
    config: dict[str, Any] = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Cmd": list(cmd), "Env": list(env), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_sha256(layer)]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": _sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER_GZIP, "digest": _sha256(layer_gz), "size": len(layer_gz)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": _sha256(manifest_bytes),
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {ANNOTATION_CONTAINERD_NAME: image.name, ANNOTATION_REF_NAME: image.tag},
            }
        ],
    }
    blobs = {_sha256(b).removeprefix("sha256:"): b for b in (layer_gz, config_bytes, manifest_bytes)}
    files: list[tuple[str, bytes]] = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        ("index.json", json.dumps(index, sort_keys=True).encode()),
        *((f"blobs/sha256/{digest}", data) for digest, data in sorted(blobs.items())),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for dirname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dirname)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


def build_pause_rootfs(rootfs: Path) -> Path:
    """/pause: a static C program compiled here with gcc (about 700 KB)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageBuildError("gcc is missing (needed for the pause image): apt-get install build-essential")
    rootfs.mkdir(parents=True, exist_ok=True)
    src = rootfs.parent / "pause.c"
    src.write_text(PAUSE_C)
    proc = subprocess.run(
        [gcc, "-static", "-Os", "-s", "-o", str(rootfs / "pause"), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    src.unlink()
    if proc.returncode != 0:
        raise ImageBuildError(f"gcc -static pause.c failed (is libc6-dev installed?): {proc.stderr.strip()}")
    return rootfs


def build_busybox_rootfs(rootfs: Path, *, index_html: str = "ok\n") -> Path:
    """busybox-static with applet symlinks, /www/index.html (for `httpd -h /www`), /etc/passwd and /tmp."""
    if not os.access(BUSYBOX, os.X_OK):
        raise ImageBuildError(
            f"{BUSYBOX} is missing: apt-get install busybox-static (scripts/test-env.sh does)"
        )
    for d in ("bin", "etc", "www", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in BUSYBOX_APPLETS:
        link = rootfs / "bin" / applet
        if not link.is_symlink():
            link.symlink_to("busybox")
    (rootfs / "www" / "index.html").write_text(index_html)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return rootfs
