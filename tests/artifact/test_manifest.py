"""The manifest: strict validation, clear messages, format versions, compatibility."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_snapshot.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    ArtifactStore,
    GpuInfo,
    Manifest,
    validate_identity_hash,
)

from .helpers import H200, HASH, IDENTITY

VALID_HASH = re.compile(r"[0-9a-f]{16}")
SHA = "a" * 64


def manifest_dict(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "format_version": 1,
        "identity_hash": HASH,
        "identity": IDENTITY.to_dict(),
        "created_at": "2026-11-29T16:00:00Z",
        "source_node": "node-a",
        "gpus": H200.model_dump(),
        "criu_version": "4.1.1",
        "agent_version": "0.1.0",
        "files": [{"path": "pages-1.img", "size": 10, "sha256": SHA}],
        "timings": {"dump": 1.0},
        "extra": {"k": [1, 2]},
    }
    return {**base, **changes}


def load(raw: dict[str, Any]) -> Manifest:
    return Manifest.from_json(json.dumps(raw))


def test_round_trip() -> None:
    m = load(manifest_dict())
    assert Manifest.from_json(m.to_json()) == m
    assert m.identity == IDENTITY
    assert m.total_bytes == 10
    assert json.loads(m.to_json())["identity"]["backendFramework"] == "vllm"


def test_identity_is_optional() -> None:
    raw = manifest_dict()
    del raw["identity"], raw["gpus"]
    m = load(raw)
    assert m.identity is None
    assert m.gpus is None
    assert "identity" not in json.loads(m.to_json())


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../pages-1.img", "contains '..'"),
        ("a/../../etc/passwd", "contains '..'"),
        ("..", "contains '..'"),
        ("/etc/passwd", "is absolute"),
        ("//x", "is absolute"),
        ("a//b", "not normalised"),
        ("./a", "not normalised"),
        ("a/", "not normalised"),
        ("", "empty"),
        ("a\\..\\b", "backslash"),
        ("a\0b", "NUL"),
        ("manifest.json", "reserved for the manifest"),
    ],
)
def test_traversal_and_odd_paths_rejected(path: str, why: str) -> None:
    raw = manifest_dict(files=[{"path": path, "size": 1, "sha256": SHA}])
    with pytest.raises(ArtifactError, match=re.escape(why)) as err:
        load(raw)
    assert "files.0.path" in str(err.value)


def test_duplicate_paths_rejected() -> None:
    entry = {"path": "a.img", "size": 1, "sha256": SHA}
    with pytest.raises(ArtifactError, match=r"files listed twice: a\.img"):
        load(manifest_dict(files=[entry, entry]))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"files": [{"path": "a", "size": -1, "sha256": SHA}]}, "files.0.size"),
        ({"files": [{"path": "a", "size": "10", "sha256": SHA}]}, "files.0.size"),
        ({"files": [{"path": "a", "size": 1, "sha256": "XYZ"}]}, "files.0.sha256"),
        ({"created_at": "2026-11-29T16:00:00"}, "created_at"),
        ({"identity_hash": "0123"}, "invalid identity hash"),
        ({"unknown": 1}, "unknown: Extra inputs are not permitted"),
        ({"timings": {"dump": -1.0}}, "timings must be finite, non-negative seconds: dump"),
        ({"format_version": 0}, "format_version"),
        ({"format_version": "1"}, "format_version"),
    ],
)
def test_strict_validation_messages(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ArtifactError, match=re.escape(message)):
        load(manifest_dict(**changes))


def test_newer_format_version_is_reported_as_such() -> None:
    # A newer format may have fields this version does not know; the version is the message.
    raw = manifest_dict(format_version=FORMAT_VERSION + 1, new_field={"x": 1})
    with pytest.raises(ArtifactError) as err:
        load(raw)
    assert str(err.value) == (
        f"manifest format_version {FORMAT_VERSION + 1} is newer than supported {FORMAT_VERSION}"
    )


def test_identity_hash_mismatch() -> None:
    with pytest.raises(ArtifactError) as err:
        load(manifest_dict(identity_hash="0000000000000000"))
    assert f"identity hash mismatch: manifest says 0000000000000000, its identity hashes to {HASH}" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [("{", "is not valid JSON"), ("[1]", "must hold a JSON object, not list"), (b"\xff", "not valid JSON")],
)
def test_not_a_manifest(data: str | bytes, message: str) -> None:
    with pytest.raises(ArtifactError, match=message):
        Manifest.from_json(data)


def test_gpu_uuids_must_match_count() -> None:
    with pytest.raises(ArtifactError, match="1 GPU uuids for a count of 2"):
        load(manifest_dict(gpus={**H200.model_dump(), "uuids": ["GPU-1"]}))


def test_compatibility_names_both_values() -> None:
    m = load(manifest_dict())
    assert m.compatibility(H200) == []
    assert m.compatibility(H200.model_copy(update={"count": 8, "uuids": []})) == []
    a100 = GpuInfo(product="NVIDIA-A100", cuda_driver_major="550", count=1)
    assert m.compatibility(a100) == [
        "GPU product NVIDIA-A100 differs from the checkpoint's NVIDIA-H200",
        "CUDA driver major 550 differs from the checkpoint's 580",
        "too few GPUs: node has 1, the checkpoint needs 2",
    ]
    assert m.compatibility(None) == ["node has no GPUs; the checkpoint needs 2 NVIDIA-H200"]
    cpu_only = load({k: v for k, v in manifest_dict().items() if k != "gpus"})
    assert cpu_only.compatibility(None) == []


@given(st.text(max_size=40))
def test_any_non_hash_string_is_refused(value: str) -> None:
    if VALID_HASH.fullmatch(value):
        return
    with pytest.raises(ValueError, match="invalid identity hash"):
        ArtifactStore(Path("/store")).path_for(value)


@given(st.from_regex(VALID_HASH, fullmatch=True))
def test_every_hash_maps_to_one_directory(value: str) -> None:
    assert validate_identity_hash(value) == value
    assert ArtifactStore(Path("/store")).path_for(value) == Path("/store") / value


@pytest.mark.parametrize(
    "value", ["../../etc/passwd", "0123456789abcdef\n", "0123456789ABCDEF", "0123456789abcdef/x", ""]
)
def test_path_like_hashes_refused(value: str) -> None:
    with pytest.raises(ValueError, match="invalid identity hash"):
        ArtifactStore(Path("/store")).path_for(value)


def chunked(**changes: Any) -> dict[str, Any]:
    return {"path": "pages-1.img", "size": 3 * 4096 + 1, "chunk_bytes": 4096, "chunks": [SHA] * 4, **changes}


def test_chunked_entry_round_trip() -> None:
    m = load(
        manifest_dict(
            format_version=FORMAT_VERSION, files=[chunked(), {"path": "e", "size": 0, "sha256": SHA}]
        )
    )
    assert Manifest.from_json(m.to_json()) == m
    assert m.files[0].chunked
    assert not m.files[1].chunked
    assert m.total_bytes == 3 * 4096 + 1
    empty = load(manifest_dict(format_version=FORMAT_VERSION, files=[chunked(size=0, chunks=[])]))
    assert empty.files[0].chunks == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (chunked(chunk_bytes=None), "files.0: pages-1.img: chunks without chunk_bytes"),
        ({**chunked(), "chunk_bytes": None}, "files.0: pages-1.img: chunks without chunk_bytes"),
        (
            chunked(chunks=[SHA] * 3),
            "files.0: pages-1.img: 3 chunks for 12289 bytes in 4096-byte chunks; need 4",
        ),
        (chunked(size=0), "files.0: pages-1.img: 4 chunks for 0 bytes in 4096-byte chunks; need 0"),
        (chunked(sha256=SHA), "files.0: pages-1.img: has both sha256 and chunks; need exactly one"),
        ({"path": "p", "size": 1}, "files.0: p: has neither sha256 nor chunks"),
        (
            {"path": "p", "size": 1, "sha256": SHA, "chunk_bytes": 4096},
            "files.0: p: chunk_bytes without chunks",
        ),
        (chunked(chunk_bytes=1000), "files.0: pages-1.img: chunk_bytes 1000 is not a multiple of 4096"),
        (chunked(chunk_bytes=0), "files.0.chunk_bytes"),
        (chunked(chunk_bytes="4096"), "files.0.chunk_bytes"),
        (chunked(chunks=[SHA, SHA, SHA, "XYZ"]), "files.0.chunks.3"),
    ],
)
def test_chunked_entry_validation(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ArtifactError) as err:
        load(manifest_dict(format_version=FORMAT_VERSION, files=[entry]))
    assert any(message in p for p in err.value.problems), err.value.problems
    assert all("\n" not in p for p in err.value.problems)


def test_version_1_manifest_without_chunks_still_loads() -> None:
    m = load(manifest_dict(format_version=1))
    assert m.format_version == 1
    assert Manifest.from_json(m.to_json()) == m
    with pytest.raises(
        ArtifactError,
        match=re.escape("format_version 1 has no chunked files, but these are chunked: pages-1.img"),
    ):
        load(manifest_dict(format_version=1, files=[chunked()]))
