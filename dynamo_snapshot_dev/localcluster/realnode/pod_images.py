"""What the real node's pods run: the images it imports into containerd, and the seccomp profile that
workers name, as on a GPU node the Helm chart set up."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot_dev.localcluster.images import (
    BUSYBOX,
    WORKER_PYTHON,
    ImageBuildError,
    ImageRef,
    build_busybox_rootfs,
    build_pause_rootfs,
    worker_image_archive,
    write_oci_archive,
)
from dynamo_snapshot_dev.localcluster.realnode.host import RealNodeError

# The seccomp profile the Helm chart installs for workers (helm/dynamo-snapshot/templates/
# seccomp-configmap.yaml): CRIU cannot dump an io_uring instance, so creating one fails with ENOSYS and
# libraries (libuv, liburing) fall back to ordinary syscalls.
NO_IO_URING_PROFILE = "profiles/dynamo-snapshot-no-io-uring.json"
NO_IO_URING_SECCOMP = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [
        {
            "names": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 38,
        }
    ],
}
PAUSE_IMAGE = ImageRef("localhost/dynamo-snapshot/pause", "3.10")
TEST_IMAGE = ImageRef("localhost/dynamo-snapshot/busybox", "1.35")


def install_seccomp_profiles(kubelet_root: Path) -> None:
    """What the chart's agent init container puts on every GPU node: the workers' io_uring-blocking
    profile, for pods that name it (`localhostProfile: profiles/<name>`)."""
    path = kubelet_root / "seccomp" / NO_IO_URING_PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(NO_IO_URING_SECCOMP, indent=1))


@dataclass(frozen=True)
class NodeImages:
    archives: list[Path]
    # The CPU reference worker's image (its tag hashes the files it holds), where it could be built.
    worker: ImageRef | None
    # Why an image is not there: what it is made of is not on this machine (one line each).
    skipped: list[str]


def build_node_images(d: Path) -> NodeImages:
    """The pause, test and CPU worker images as OCI archives under `d` (the worker's is cached elsewhere).

    The pause image is always needed. The test image is made of the machine's busybox-static and the
    worker's of Debian's python3.11 (and busybox): a machine without them (the GPU machine: Ubuntu, no
    busybox) gets the node without those images, and the reason."""
    shutil.rmtree(d, ignore_errors=True)
    skipped: list[str] = []
    worker_image = None
    try:
        archives = [
            write_oci_archive(
                d / "pause.tar", build_pause_rootfs(d / "pause-rootfs"), PAUSE_IMAGE, entrypoint=["/pause"]
            )
        ]
        if BUSYBOX.exists():
            rootfs = build_busybox_rootfs(d / "busybox-rootfs")
            archives.append(write_oci_archive(d / "busybox.tar", rootfs, TEST_IMAGE, entrypoint=["/bin/sh"]))
        else:
            skipped.append(f"the test image {TEST_IMAGE.name}: no {BUSYBOX} on this machine")
        lacking = [str(p) for p in (WORKER_PYTHON, BUSYBOX) if not p.exists()]
        if lacking:
            skipped.append(f"the CPU worker image: no {' or '.join(lacking)} on this machine")
        else:
            worker_image, worker = worker_image_archive()
            archives.append(worker)
    except ImageBuildError as e:
        raise RealNodeError(str(e)) from None
    return NodeImages(archives, worker_image, skipped)
