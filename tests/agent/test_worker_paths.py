"""What a hostile tenant plants in its control directory (links to files and directories, hard links to
the host's or another pod's files, '..', FIFOs, devices) never makes the privileged agent read or write
outside it: the weights it carries at checkpoint and puts back at restore are refused with a clear
message, the worker is left running (checkpoint) or never resumed (restore), and the outside files are
as they were."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest

from dynamo_snapshot.agent.executor import AgentError
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.agent.weights import (
    CarriedWeights,
    WeightsPlacementError,
    WorkerFile,
    capture_weights,
    locate,
    place_weights,
    read_offload,
)
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.fileio.pagecache import page_cache_fraction
from dynamo_snapshot.workload.weights import (
    OffloadManifest,
    WeightsFile,
    WeightsHeader,
    data_digest,
    plan_layout,
    write_weights_manifest,
)
from tests.agent.local_node import checkpoint_worker, checkpoint_worker_outcome, local_executor

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "test/hostile", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)


def _weights_bytes(fill: int) -> tuple[bytes, str]:
    """A small file in the weights format (header + data) and its data digest."""
    nbytes = 4096
    digests = [bytes([fill]).hex() * 32]
    specs, _ = plan_layout([("w", "uint8", (nbytes,), nbytes)], 256)
    header = WeightsHeader(
        tensors=tuple(specs),
        data_bytes=nbytes,
        device_bytes=nbytes,
        chunk_bytes=nbytes,
        chunk_sha256=tuple(digests),
        data_digest=data_digest(digests),
    )
    return header.encode() + bytes([fill]) * nbytes, header.data_digest


@pytest.fixture
def pod(tmp_path: Path) -> tuple[Path, Path, bytes, str]:
    """A pod's host control dir, the host files beside it, and a weights file's bytes and digest."""
    ctl, host = tmp_path / "pod-ctl", tmp_path / "host"
    ctl.mkdir()
    host.mkdir()
    content, digest = _weights_bytes(7)
    (host / "other-tenant.dsw").write_bytes(content)
    return ctl, host, content, digest


def _offload(path: str, content: bytes, digest: str) -> OffloadManifest:
    return OffloadManifest([WeightsFile(path, len(content), digest, 0)], {0: 4096})


def _capture(ctl: Path, staging: Path, offload: OffloadManifest) -> list[CarriedWeights]:
    located = {f.path: locate(f.path, "/ctl", ctl, host_process=False) for f in offload.files}
    return capture_weights(offload, located, staging)


def _file_link(ctl: Path, host: Path) -> None:
    (ctl / "weights" / "m.dsw").symlink_to(host / "other-tenant.dsw")


def _directory_link(ctl: Path, host: Path) -> None:
    (ctl / "weights").rmdir()
    (ctl / "weights").symlink_to(host)


def _hard_link(ctl: Path, host: Path) -> None:
    os.link(host / "other-tenant.dsw", ctl / "weights" / "m.dsw")


def _fifo(ctl: Path, host: Path) -> None:
    os.mkfifo(ctl / "weights" / "m.dsw")


def _device(ctl: Path, host: Path) -> None:
    os.mknod(ctl / "weights" / "m.dsw", stat.S_IFCHR | 0o600, os.makedev(1, 5))


def _directory(ctl: Path, host: Path) -> None:
    (ctl / "weights" / "m.dsw").mkdir()


# Each planted where the worker's weights file should be, in a control dir with a weights/ directory.
PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "file-link": _file_link,
    "directory-link": _directory_link,
    "hard-link": _hard_link,
    "fifo": _fifo,
    "device": _device,
    "directory": _directory,
}
REFUSED_AT_CHECKPOINT = {
    "file-link": "is a symbolic link",
    "directory-link": "'weights' is a symbolic link",
    "hard-link": "has 2 hard links",
    "fifo": "is a FIFO",
    "device": "is a character device",
    "directory": "is a directory",
}
REFUSED_AT_RESTORE = {
    "file-link": "is a symbolic link; not replacing it",
    "directory-link": "'weights' is a symbolic link",
    "hard-link": "has 2 hard links",
    "fifo": "is a FIFO; not replacing it",
    "device": "is a character device; not replacing it",
    "directory": "is a directory; not replacing it",
}


@pytest.mark.parametrize("plant", PLANTS)
def test_checkpoint_carries_no_planted_file(
    pod: tuple[Path, Path, bytes, str], tmp_path: Path, plant: str
) -> None:
    ctl, host, content, digest = pod
    (ctl / "weights").mkdir()
    PLANTS[plant](ctl, host)
    if plant == "directory-link":
        # The directory link names the outside file under the worker's own name.
        os.rename(host / "other-tenant.dsw", host / "m.dsw")
    outside = sorted(host.iterdir())
    links_before = [p.stat().st_nlink for p in outside]
    done = threading.Event()
    refused: list[str] = []

    def attempt() -> None:
        with pytest.raises(WeightsPlacementError) as e:
            _capture(ctl, tmp_path / "staging", _offload("/ctl/weights/m.dsw", content, digest))
        refused.append(str(e.value))
        done.set()

    threading.Thread(target=attempt, daemon=True).start()
    assert done.wait(5), "the capture blocked on the planted file"
    assert REFUSED_AT_CHECKPOINT[plant] in refused[0]
    assert "/ctl/weights/m.dsw" in refused[0]
    assert [p.stat().st_nlink for p in outside] == links_before, "an outside file was linked"
    assert not list((tmp_path / "staging").rglob("*.dsw"))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/ctl/../host/other-tenant.dsw", "without '..'"),
        ("/host/other-tenant.dsw", "outside the control dir"),
        ("ctl/weights/m.dsw", "must be absolute"),
    ],
)
def test_paths_that_leave_the_control_dir_are_refused(
    pod: tuple[Path, Path, bytes, str], tmp_path: Path, path: str, message: str
) -> None:
    _, _, content, digest = pod
    ctl = pod[0]
    with pytest.raises(WeightsPlacementError, match=message):
        _capture(ctl, tmp_path / "staging", _offload(path, content, digest))


def test_a_regular_file_of_the_worker_is_carried(pod: tuple[Path, Path, bytes, str], tmp_path: Path) -> None:
    ctl, _, content, digest = pod
    (ctl / "weights").mkdir()
    (ctl / "weights" / "m.dsw").write_bytes(content)
    carried = _capture(ctl, tmp_path / "staging", _offload("/ctl/weights/m.dsw", content, digest))
    assert [c.file for c in carried] == ["weights/00-m.dsw"]
    assert (tmp_path / "staging" / "weights" / "00-m.dsw").read_bytes() == content


def test_weights_json_planted_as_a_link_or_fifo_is_not_read(pod: tuple[Path, Path, bytes, str]) -> None:
    ctl, host, content, digest = pod
    write_weights_manifest(host, [WeightsFile("/ctl/weights/m.dsw", len(content), digest, 0)], {})
    (ctl / "weights.json").symlink_to(host / "weights.json")
    with pytest.raises(ValueError, match="symbolic link"):
        read_offload(ctl)
    (ctl / "weights.json").unlink()
    os.mkfifo(ctl / "weights.json")
    with pytest.raises(ValueError, match="FIFO"):
        read_offload(ctl)
    (ctl / "weights.json").unlink()
    assert read_offload(ctl) is None


def _carried(content: bytes, digest: str) -> CarriedWeights:
    return CarriedWeights("/ctl/weights/m.dsw", "weights/00-m.dsw", digest, 0)


@pytest.mark.parametrize("plant", PLANTS)
def test_restore_writes_nothing_through_a_planted_name(
    pod: tuple[Path, Path, bytes, str], tmp_path: Path, plant: str
) -> None:
    ctl, host, _, _ = pod
    ours, digest = _weights_bytes(9)
    artifact = tmp_path / "artifact-file.dsw"
    artifact.write_bytes(ours)
    (ctl / "weights").mkdir()
    PLANTS[plant](ctl, host)
    outside = {p: (p.read_bytes(), p.stat().st_nlink) for p in host.iterdir()}
    target = locate("/ctl/weights/m.dsw", "/ctl", ctl, host_process=False)
    with pytest.raises(WeightsPlacementError) as e:
        place_weights(artifact, target, _carried(ours, digest))
    assert REFUSED_AT_RESTORE[plant] in str(e.value)
    assert {p: (p.read_bytes(), p.stat().st_nlink) for p in host.iterdir()} == outside
    assert artifact.stat().st_nlink == 1, "the artifact's file got a name somewhere"


def test_restore_links_into_fresh_directories(pod: tuple[Path, Path, bytes, str], tmp_path: Path) -> None:
    ctl, _, _, _ = pod
    ours, digest = _weights_bytes(9)
    artifact = tmp_path / "artifact-file.dsw"
    artifact.write_bytes(ours)
    target = locate("/ctl/deep/weights/m.dsw", "/ctl", ctl, host_process=False)
    place_weights(artifact, target, CarriedWeights("/ctl/deep/weights/m.dsw", "f", digest, 0))
    assert os.path.samefile(ctl / "deep" / "weights" / "m.dsw", artifact)
    # Again, as a second restore into the same directory finds it: nothing to do.
    place_weights(artifact, target, CarriedWeights("/ctl/deep/weights/m.dsw", "f", digest, 0))
    assert sorted(p.name for p in (ctl / "deep" / "weights").iterdir()) == ["m.dsw"]
    assert target == WorkerFile(ctl, PurePosixPath("deep/weights/m.dsw"))


def _copied_into(ctl: Path, artifact: Path, digest: str) -> Path:
    target = locate("/ctl/weights/m.dsw", "/ctl", ctl, host_process=False)
    place_weights(artifact, target, CarriedWeights("/ctl/weights/m.dsw", "f", digest, 0))
    placed = ctl / "weights" / "m.dsw"
    assert not os.path.samefile(placed, artifact)
    assert placed.read_bytes() == artifact.read_bytes()
    assert placed.stat().st_nlink == 1
    assert artifact.stat().st_nlink == 1
    # The worker loads the copy from memory (buffered), not back from the disk.
    assert page_cache_fraction(placed) == 1.0
    return placed


def test_restore_copies_across_file_systems(pod: tuple[Path, Path, bytes, str]) -> None:
    """An artifact store on another file system: the link fails, and the copy goes through user space."""
    ctl, _, _, _ = pod
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(ctl).st_dev:
        pytest.skip("no /dev/shm on another file system than the test's directory")
    ours, digest = _weights_bytes(9)
    with tempfile.TemporaryDirectory(dir=shm) as store:
        artifact = Path(store) / "artifact-file.dsw"
        artifact.write_bytes(ours)
        _copied_into(ctl, artifact, digest)


def test_restore_copies_across_mounts_of_one_file_system(
    pod: tuple[Path, Path, bytes, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's directory is a mount of its own, so link(2) answers EXDEV on one file system too
    (made to answer so here); the kernel copies with copy_file_range."""
    ctl, _, _, _ = pod
    ours, digest = _weights_bytes(9)
    artifact = tmp_path / "artifact-file.dsw"
    artifact.write_bytes(ours)

    def across_mounts(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", across_mounts)
    _copied_into(ctl, artifact, digest)


# ---------------------------------------------------------------- through the Executor, with real CRIU
@pytest.mark.criu
@pytest.mark.parametrize("plant", ["symlink", "hardlink", "dirlink"])
async def test_a_worker_with_planted_weights_is_refused_before_it_is_suspended(
    criu_bin: Path, tmp_path: Path, plant: str
) -> None:
    executor, runtime = local_executor(tmp_path, criu_bin)
    outside = tmp_path / "host"
    env = {"WORKER_PLANT": plant, "WORKER_OUTSIDE": str(outside)}
    with pytest.raises(AgentError, match="cannot carry the worker's weights") as e:
        await checkpoint_worker_outcome(executor, runtime, WORKER, HASH, env, identity=IDENTITY)
    assert "weights/model.dsw" in str(e.value)
    source = await runtime.find("source")
    assert source is not None
    assert pid_running(source.pid), "a refused worker must keep running"
    try:
        assert (outside / "model.dsw").stat().st_nlink == (2 if plant == "hardlink" else 1)
        assert not executor.store.exists(HASH)
    finally:
        await runtime.stop("source")


@pytest.mark.criu
@pytest.mark.parametrize("plant", ["directory-link", "file-link", "fifo"])
async def test_a_restore_into_a_planted_control_dir_never_resumes_the_worker(
    criu_bin: Path, tmp_path: Path, plant: str
) -> None:
    executor, runtime = local_executor(tmp_path, criu_bin)
    source = await checkpoint_worker(executor, runtime, WORKER, HASH, identity=IDENTITY)
    ctl, host = source.control_dir, tmp_path / "host"
    host.mkdir()
    (host / "model.dsw").write_bytes(b"the host's file")
    ctl.mkdir(parents=True, exist_ok=True)
    if plant == "directory-link":
        (ctl / "weights").symlink_to(host)
    else:
        (ctl / "weights").mkdir()
        if plant == "file-link":
            (ctl / "weights" / "model.dsw").symlink_to(host / "model.dsw")
        else:
            os.mkfifo(ctl / "weights" / "model.dsw")
    with pytest.raises(AgentError, match="cannot put the weights back") as e:
        await executor.restore("restored", HASH)
    assert "weights" in str(e.value)
    assert (host / "model.dsw").read_bytes() == b"the host's file"
    assert sorted(p.name for p in host.iterdir()) == ["model.dsw"]
    assert not (ctl / "verify.json").exists()
    assert await runtime.find("restored") is None
