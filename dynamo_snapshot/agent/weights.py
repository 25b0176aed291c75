"""Decoupled weights on the agent's side: carry the worker's weights files in the artifact, put them back
where the restored worker looks for them, and refuse a restore whose GPU memory will not fit.

A worker that uses the SDK's GpuOffload saves its weights to a file, releases them and the KV cache, and
lists the files and the released bytes in the control directory's weights.json. At checkpoint the agent
hard-links (or, across filesystems, copies) each file into the artifact under `weights/`, so the CRIU
image holds process state only and the weights are sealed with the artifact's chunk digests. At restore
the agent checks each file's size and header against the artifact before anything starts, verifies
its chunk digests while CRIU restores the process (the same parallel read fills the page cache the
worker then loads from), and links it back to the path the worker recorded before the worker resumes.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import JsonValue

from dynamo_snapshot.api import protocol
from dynamo_snapshot.fileio import copy_file
from dynamo_snapshot.workload.weights import OffloadManifest, WeightsFileError, read_header

__all__ = [
    "CarriedWeights",
    "WeightsPlacementError",
    "capture_weights",
    "check_carried",
    "gpu_memory_problem",
    "host_path",
    "place_weights",
    "weights_features",
]

_MIB = 1 << 20


class WeightsPlacementError(Exception):
    """The weights cannot be carried or put back; the message says which file and why."""


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


def host_path(
    worker_path: str, seen_control_dir: str, host_control_dir: Path, *, containerized: bool
) -> Path:
    """The host path behind a path the worker uses: inside its control dir it is the pod's host
    directory; elsewhere it is the same path for a host process and unsupported in a container."""
    worker = PurePosixPath(worker_path)
    if not worker.is_absolute() or ".." in worker.parts:
        raise WeightsPlacementError(f"weights path {worker_path!r} must be absolute, without '..'")
    try:
        rel = worker.relative_to(seen_control_dir)
    except ValueError:
        if containerized:
            raise WeightsPlacementError(
                f"weights file {worker_path} is outside the control dir {seen_control_dir}: a container's "
                "weights must be saved under its control dir so the agent can carry them"
            ) from None
        return Path(worker)
    return host_control_dir / rel


def capture_weights(
    offload: OffloadManifest, to_host: dict[str, Path], staging: Path
) -> list[CarriedWeights]:
    """Link (or copy) each weights file into `staging/weights/`; `to_host` maps worker paths to host
    paths. The files' own headers are read to check they are what weights.json says."""
    carried = []
    for i, entry in enumerate(offload.files):
        src = to_host[entry.path]
        try:
            header, _ = read_header(src)
            size = src.stat().st_size
        except FileNotFoundError:
            raise WeightsPlacementError(
                f"weights file {entry.path} named in weights.json is missing"
            ) from None
        except (OSError, WeightsFileError) as e:
            raise WeightsPlacementError(f"weights file {entry.path}: {e}") from None
        if header.data_digest != entry.data_digest or size != entry.bytes:
            raise WeightsPlacementError(
                f"weights file {entry.path} changed after the worker saved it "
                f"({size} bytes, data digest {header.data_digest[:16]}…; weights.json says "
                f"{entry.bytes} bytes, {entry.data_digest[:16]}…)"
            )
        rel = f"{protocol.ARTIFACT_WEIGHTS_DIR}/{i:02d}-{Path(entry.path).name}"
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            # A hard link costs nothing; the worker replaces its file by rename, never in place.
            os.link(src, dest)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            copy_file(src, dest)
        carried.append(CarriedWeights(entry.path, rel, entry.data_digest, entry.device))
    return carried


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


def place_weights(artifact_file: Path, target: Path, weights: CarriedWeights) -> None:
    """Make `target` the artifact's copy (size and header checked; its checksums may still be being
    checked, see Executor.restore). A file already there with the same weights is replaced by the
    link; one with other weights is never overwritten."""
    if target.exists():
        if os.path.samefile(target, artifact_file):
            return
        try:
            existing, _ = read_header(target)
            digest: str | None = existing.data_digest
        except (OSError, WeightsFileError):
            digest = None
        if digest != weights.data_digest:
            raise WeightsPlacementError(
                f"{weights.worker_path} on this node holds other weights "
                f"(data digest {digest[:16] + '…' if digest else 'unreadable'}; the checkpoint's are "
                f"{weights.data_digest[:16]}…); not overwriting it"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(artifact_file, tmp)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        os.symlink(artifact_file, tmp)
    os.replace(tmp, target)


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
