"""Small builders shared by the artifact tests."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import (
    DEFAULT_CHUNK_BYTES,
    ArtifactStore,
    ArtifactWriter,
    GpuInfo,
    PublishResult,
)

IDENTITY = CheckpointIdentity(model="meta-llama/Llama-3-8B", backend_framework="vllm", dtype="bfloat16")
HASH = IDENTITY.compute_hash()
H200 = GpuInfo(
    product="NVIDIA-H200",
    driver_version="580.159.04",
    cuda_driver_major="580",
    count=2,
    uuids=["GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-aaaaaaaa-0000-0000-0000-000000000002"],
    memory_mib=143771,
)


def sample_files() -> dict[str, bytes]:
    return {
        "inventory.img": b"\x01inventory",
        "pages-1.img": os.urandom(3 << 20),
        "pagemap-1.img": os.urandom(1000),
        "cuda/gpu-0.bin": os.urandom(1 << 20),
        "empty.img": b"",
    }


def stage(directory: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)


async def publish(
    store: ArtifactStore,
    files: dict[str, bytes],
    identity_hash: str = HASH,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> PublishResult:
    with ArtifactWriter(store, identity_hash) as writer:
        stage(writer.directory, files)
        return await writer.publish(
            chunk_bytes=chunk_bytes,
            criu_version="4.1.1",
            gpus=H200,
            identity=IDENTITY if identity_hash == HASH else None,
            source_node="node-a",
            timings={"dump": 1.5},
            extra={"runtime": "process"},
        )


def refuse_direct_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT accepted at open but each read of such a file refused (EINVAL), as some filesystems do."""
    real_preadv = os.preadv

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)
