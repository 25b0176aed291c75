"""Decoupled weights on the agent's side: carry the worker's weights files in the artifact, put them back
where the restored worker looks for them, and refuse a restore whose GPU memory will not fit.

A worker that uses the SDK's GpuOffload saves its weights to a file, releases them and the KV cache, and
lists the files and the released bytes in the control directory's weights.json. At checkpoint the agent
hard-links (or, across filesystems, copies) each file into the artifact under `weights/`, so the CRIU
image holds process state only and the weights are sealed with the artifact's chunk digests. At restore
the agent checks each file's size and header against the artifact before anything starts, verifies
its chunk digests while CRIU restores the process (the same parallel read fills the page cache the
worker then loads from), and links it (or, across mounts, copies it through the page cache) back to the
path the worker recorded before the worker resumes.

Every path here comes from the worker (weights.json, and the manifest's record of it), so each is
resolved beneath the control directory's descriptor, never through a link, a `..` or a mount point
(``fileio.beneath``), at checkpoint and at restore: what the agent links into an artifact is a regular
file of the worker's own with no other name, and what it puts back lands inside the restore pod's
control directory or nowhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import JsonValue

from dynamo_snapshot.api import protocol
from dynamo_snapshot.fileio import copy_file
from dynamo_snapshot.fileio.beneath import (
    UnsafePath,
    fd_path,
    kind_of,
    lstat_beneath,
    open_dirs_beneath,
    open_regular_beneath,
    opened_dir,
    read_json_beneath,
    temporary_name,
)
from dynamo_snapshot.workload.weights import (
    OffloadManifest,
    WeightsFileError,
    parse_offload_manifest,
    read_header,
)

__all__ = [
    "CarriedWeights",
    "WeightsNotLinked",
    "WeightsPlacementError",
    "WorkerFile",
    "capture_weights",
    "check_carried",
    "gpu_memory_problem",
    "locate",
    "place_weights",
    "read_offload",
    "weights_features",
]

_MIB = 1 << 20
# weights.json lists a few files; anything this long is not one.
_MAX_MANIFEST_BYTES = 1 << 20


class WeightsPlacementError(Exception):
    """The weights cannot be carried or put back; the message says which file and why."""


class WeightsNotLinked(WeightsPlacementError):
    """A placement that had to be a link (the file still being written) cannot be one here."""


@dataclass(frozen=True)
class CarriedWeights:
    """One weights file as the artifact manifest's `extra.weights` records it."""

    worker_path: str  # where the worker saved it and will load it from, as the worker sees it
    file: str  # relative path inside the artifact
    data_digest: str  # the weights header's digest: tells this model's weights from another's
    device: int

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "workerPath": self.worker_path,
            "file": self.file,
            "dataDigest": self.data_digest,
            "device": self.device,
        }

    @classmethod
    def from_json(cls, raw: JsonValue) -> CarriedWeights:
        if not isinstance(raw, dict):
            raise WeightsPlacementError(f"bad weights entry in the artifact manifest: {raw!r}")
        try:
            worker_path, file, digest, device = (
                raw["workerPath"],
                raw["file"],
                raw["dataDigest"],
                raw["device"],
            )
        except KeyError as e:
            raise WeightsPlacementError(f"weights entry in the artifact manifest lacks {e}") from None
        if not (isinstance(worker_path, str) and isinstance(file, str) and isinstance(digest, str)):
            raise WeightsPlacementError(f"bad weights entry in the artifact manifest: {raw!r}")
        if not isinstance(device, int) or isinstance(device, bool):
            raise WeightsPlacementError(f"bad weights entry in the artifact manifest: {raw!r}")
        return cls(worker_path, file, digest, device)


@dataclass(frozen=True)
class WorkerFile:
    """A file the worker names, as the agent reaches it: ``rel`` resolved beneath the directory ``base``
    (the host directory behind the worker's control directory), never through a link."""

    base: Path
    rel: PurePosixPath

    def __str__(self) -> str:
        return str(self.base / self.rel)


def locate(
    worker_path: str, seen_control_dir: str, host_control_dir: Path, *, host_process: bool
) -> WorkerFile:
    """Where the agent finds a path the worker uses: inside its control dir, beneath the pod's host
    directory. Only a worker that is itself a host process (the ``local`` runtime) may name a file
    elsewhere; a container's path outside its control dir names nothing the agent may open."""
    worker = PurePosixPath(worker_path)
    if not worker.is_absolute() or ".." in worker.parts:
        raise WeightsPlacementError(f"weights path {worker_path!r} must be absolute, without '..'")
    try:
        rel = worker.relative_to(seen_control_dir)
    except ValueError:
        if not host_process:
            raise WeightsPlacementError(
                f"weights file {worker_path} is outside the control dir {seen_control_dir}: a container's "
                "weights must be saved under its control dir so the agent can carry them"
            ) from None
        return WorkerFile(Path(worker.parent), PurePosixPath(worker.name))
    if not rel.parts:
        raise WeightsPlacementError(f"weights path {worker_path!r} is the control dir itself")
    return WorkerFile(host_control_dir, rel)


def read_offload(control_dir: Path) -> OffloadManifest | None:
    """The worker's weights.json, read as any file the worker wrote (``fileio.beneath.read_json_beneath``);
    None when there is none."""
    try:
        doc = read_json_beneath(
            control_dir / protocol.FILE_WEIGHTS_MANIFEST, _MAX_MANIFEST_BYTES, what="worker file"
        )
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    return parse_offload_manifest(doc)


def capture_weights(
    offload: OffloadManifest, located: dict[str, WorkerFile], staging: Path
) -> list[CarriedWeights]:
    """Link (or copy) each weights file into `staging/weights/`; `located` maps worker paths to where
    the agent finds them. The files' own headers are read to check they are what weights.json says."""
    carried = []
    for i, entry in enumerate(offload.files):
        rel = f"{protocol.ARTIFACT_WEIGHTS_DIR}/{i:02d}-{PurePosixPath(entry.path).name}"
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _worker_file(located[entry.path], entry.path) as handle:
            src = fd_path(handle)
            try:
                header, _ = read_header(src)
            except (OSError, WeightsFileError) as e:
                raise WeightsPlacementError(f"weights file {entry.path}: {e}") from None
            size = os.fstat(handle).st_size
            if header.data_digest != entry.data_digest or size != entry.bytes:
                raise WeightsPlacementError(
                    f"weights file {entry.path} changed after the worker saved it "
                    f"({size} bytes, data digest {header.data_digest[:16]}…; weights.json says "
                    f"{entry.bytes} bytes, {entry.data_digest[:16]}…)"
                )
            try:
                # A hard link costs nothing; the worker replaces its file by rename, never in place.
                os.link(src, dest)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                copy_file(src, dest)
        carried.append(CarriedWeights(entry.path, rel, entry.data_digest, entry.device))
    return carried


@contextlib.contextmanager
def _worker_file(where: WorkerFile, shown: str) -> Iterator[int]:
    """An O_PATH descriptor of the worker's regular file (one name, reached without a link)."""
    try:
        with opened_dir(where.base) as base:
            handle = open_regular_beneath(base, where.rel, what="weights file")
    except FileNotFoundError:
        raise WeightsPlacementError(f"weights file {shown} named in weights.json is missing") from None
    except UnsafePath as e:
        raise WeightsPlacementError(f"{e.strerror} (the worker's {shown})") from None
    except OSError as e:
        raise WeightsPlacementError(f"weights file {shown}: {e.strerror or e}") from None
    try:
        yield handle
    finally:
        os.close(handle)


def check_carried(artifact_file: Path, weights: CarriedWeights) -> None:
    """The artifact's weights file is the one the checkpoint carried: its header names the same data
    digest. With the sizes the artifact seals, this catches a missing, truncated or substituted file
    before anything starts; the bytes are checked against the artifact's chunk digests meanwhile."""
    try:
        header, _ = read_header(artifact_file)
    except FileNotFoundError:
        raise WeightsPlacementError(f"missing file: {weights.file}") from None
    except (OSError, WeightsFileError) as e:
        raise WeightsPlacementError(f"{weights.file} is not the checkpoint's weights file: {e}") from None
    if header.data_digest != weights.data_digest:
        raise WeightsPlacementError(
            f"{weights.file} holds other weights (data digest {header.data_digest[:16]}…; the checkpoint "
            f"carried {weights.data_digest[:16]}…)"
        )


def place_weights(
    artifact_file: Path, target: WorkerFile, weights: CarriedWeights, *, link_only: bool = False
) -> None:
    """Make `target` the artifact's copy (size and header checked; its checksums may still be being
    checked, see Executor.restore). Its directories are made beneath the control dir without following
    a link; a file already there with the same weights is replaced by the link; one with other weights,
    or a link, FIFO, device or directory under that name, is never touched. With `link_only` (a file
    still being written) WeightsNotLinked where it cannot be linked there, and nothing is copied."""
    try:
        with opened_dir(target.base) as base:
            parent = target.rel.parent
            directory = open_dirs_beneath(base, parent, create=True) if parent.parts else os.dup(base)
            try:
                _place(artifact_file, directory, target.rel.name, weights, link_only)
            finally:
                os.close(directory)
    except UnsafePath as e:
        raise WeightsPlacementError(f"{e.strerror} (where the worker loads {weights.worker_path})") from None


def _place(artifact_file: Path, directory: int, name: str, weights: CarriedWeights, link_only: bool) -> None:
    st = lstat_beneath(directory, name)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise WeightsPlacementError(
                f"{weights.worker_path} on this node is {kind_of(st.st_mode)}; not replacing it"
            )
        ours = os.stat(artifact_file)
        if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
            return
        if st.st_nlink != 1:
            raise WeightsPlacementError(
                f"{weights.worker_path} on this node has {st.st_nlink} hard links (it may be a file from "
                "outside the control dir); not reading or replacing it"
            )
        digest = _digest_of(directory, name)
        if digest != weights.data_digest:
            raise WeightsPlacementError(
                f"{weights.worker_path} on this node holds other weights "
                f"(data digest {digest[:16] + '…' if digest else 'unreadable'}; the checkpoint's are "
                f"{weights.data_digest[:16]}…); not overwriting it"
            )
    tmp = temporary_name(name)
    try:
        try:
            os.link(artifact_file, tmp, dst_dir_fd=directory)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            if link_only:
                raise WeightsNotLinked(f"{weights.worker_path}: {e.strerror}") from None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=directory)
            try:
                _copy_into(artifact_file, fd)
            finally:
                os.close(fd)
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise


# What copy_file_range says where it cannot copy between these two files (older kernels across mount
# points, some file systems): the copy goes through user space instead.
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _copy_into(artifact_file: Path, fd: int) -> None:
    """The artifact's weights into the worker's new, empty file ``fd``, through the page cache.

    A restore pod's control dir is another mount than the artifact store (the kubelet's directory is a
    shared mount of its own), so the link fails across it even on one file system. The kernel copies
    (or, where the file system shares extents, clones) with copy_file_range, from the pages the weights
    check just read, and the worker then loads from memory. Not synced: the copy lives as long as the
    pod's directory, and a crash loses the pod too."""
    with open(artifact_file, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(src.fileno(), fd, size - done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY or done:
                raise
            copy_file(artifact_file, fd_path(fd), direct=False, fsync=False)
            return
    if done != size:
        raise WeightsPlacementError(f"{artifact_file} ended after {done} of its {size} bytes")


def _digest_of(directory: int, name: str) -> str | None:
    """The data digest in the header of the regular file ``name``; None when it is no weights file."""
    try:
        handle = open_regular_beneath(directory, name, what="weights file")
    except OSError:
        return None
    try:
        existing, _ = read_header(fd_path(handle))
        return existing.data_digest
    except (OSError, WeightsFileError):
        return None
    finally:
        os.close(handle)


def gpu_memory_problem(free_mib: list[int], held_mib: int, released_mib: int) -> str | None:
    """Why GPUs with `free_mib` free cannot take back what the worker held plus what it released."""
    need_mib = held_mib + released_mib
    free = sum(free_mib)
    if free >= need_mib:
        return None
    return (
        f"not enough free GPU memory: {free} MiB free on {len(free_mib)} GPU(s), the checkpoint needs "
        f"{need_mib} MiB ({held_mib} MiB held by the worker at checkpoint + {released_mib} MiB it maps "
        "again after the restore)"
    )


def mib(nbytes: int) -> int:
    return -(-nbytes // _MIB)


def weights_features(files: list[Path]) -> set[str]:
    """The artifact features carried weights files need: ``<encoding>-weights`` for each encoding other
    than plain (split-nibble: ``split-nibble-weights``), so a reader that cannot hand such files to a
    worker refuses the artifact by that name."""
    features = set()
    for path in files:
        try:
            header, _ = read_header(path)
        except (OSError, WeightsFileError) as e:
            raise WeightsPlacementError(f"weights file {path.name}: {e}") from None
        if header.encoding is not None:
            features.add(f"{header.encoding.name}-weights")
    return features
