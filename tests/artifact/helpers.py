"""Small builders shared by the artifact tests."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import JsonValue

from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import (
    MANIFEST_NAME,
    ArtifactStore,
    ArtifactWriter,
    Binding,
    GpuInfo,
    PublishResult,
)
from dynamo_snapshot.artifact.manifest import canonical_digest
from dynamo_snapshot.fileio import DEFAULT_CHUNK_BYTES

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


NAMESPACE = "tenant-a"
CHECKPOINT_UID = "3f1c2b9e-7d4a-4c1e-9b2f-0a6d8e5c4b31"
BINDING = Binding(
    namespace=NAMESPACE,
    checkpoint_name="llama-3-8b",
    checkpoint_uid=CHECKPOINT_UID,
    source_pod="llama-3-8b-checkpoint-x7k2p",
    source_pod_uid="9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",
)
KEY = f"{NAMESPACE}/{CHECKPOINT_UID}"


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
    binding: Binding | None = None,
    extra: dict[str, JsonValue] | None = None,
) -> PublishResult:
    """Publish ``files`` under ``binding``'s key, or (without one) under ``identity_hash``."""
    key = binding.key if binding is not None else identity_hash
    with ArtifactWriter(store, identity_hash, key=key) as writer:
        stage(writer.directory, files)
        return await writer.publish(
            chunk_bytes=chunk_bytes,
            criu_version="4.1.1",
            gpus=H200,
            identity=IDENTITY if identity_hash == HASH else None,
            source_node="node-a",
            timings={"dump": 1.5},
            extra=extra if extra is not None else {"runtime": "process"},
            binding=binding,
        )


def read_manifest(artifact_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((artifact_dir / MANIFEST_NAME).read_text())
    return data


def write_manifest(artifact_dir: Path, raw: dict[str, Any], *, reseal: bool = False) -> None:
    """Write ``raw`` as the artifact's manifest; ``reseal`` gives it the digest of its new content (an
    edit made by someone who knows the sealing rule)."""
    if reseal:
        raw = {**raw, "digest": canonical_digest(raw)}
    (artifact_dir / MANIFEST_NAME).write_text(json.dumps(raw, indent=2))


def as_format(raw: dict[str, Any], version: int) -> dict[str, Any]:
    """``raw`` as an older agent wrote it: ``format_version`` ``version``, unsealed, unbound, no features."""
    older = {k: v for k, v in raw.items() if k not in ("digest", "binding", "features")}
    return {**older, "format_version": version}


def refuse_direct_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT accepted at open but each read of such a file refused (EINVAL), as some filesystems do."""
    real_preadv = os.preadv

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)


def flip_a_byte(path: Path, offset: int) -> None:
    """Change the byte at ``offset`` of ``path`` in place (the file's own inode: its size stays right)."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
