"""The manifest: strict validation, clear messages, format versions, the seal, bindings, store keys,
compatibility."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from dynamo_snapshot.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    ArtifactStore,
    Binding,
    GpuInfo,
    Manifest,
    artifact_key,
    validate_artifact_key,
    validate_identity_hash,
)
from dynamo_snapshot.artifact.manifest import canonical_digest

from .helpers import BINDING, CHECKPOINT_UID, H200, HASH, IDENTITY, KEY, NAMESPACE

VALID_HASH = re.compile(r"[0-9a-f]{16}")
VALID_BOUND_KEY = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?/[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}")
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
    version = changes.get("format_version", base["format_version"])
    if isinstance(version, int) and version >= 4:
        base["features"] = []  # from format 4 on a manifest lists its features, none here
    return {**base, **changes}


def load(raw: dict[str, Any]) -> Manifest:
    """``raw`` parsed; a manifest of a sealed format gets its digest first, as a writer gives it (one that
    is invalid gets the digest of its content, so that validation has the last word)."""
    version = raw.get("format_version")
    if isinstance(version, int) and version >= 3 and "digest" not in raw:
        try:
            raw = json.loads(Manifest.model_validate(raw).sealed().to_json())
        except ValidationError:
            raw = {**raw, "digest": canonical_digest(raw)}
    return Manifest.from_json(json.dumps(raw))


def sealed_dict(**changes: Any) -> dict[str, Any]:
    """A current-format manifest, bound to ``BINDING``, as a writer writes it (sealed)."""
    raw = manifest_dict(format_version=FORMAT_VERSION, binding=BINDING.model_dump(), **changes)
    data: dict[str, Any] = json.loads(Manifest.model_validate(raw).sealed().to_json())
    return data


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


@given(st.text(max_size=120))
def test_any_string_that_is_no_key_is_refused(value: str) -> None:
    if VALID_HASH.fullmatch(value) or (VALID_BOUND_KEY.fullmatch(value) and len(value.split("/")[0]) <= 63):
        return
    with pytest.raises(ValueError, match="invalid artifact key"):
        ArtifactStore(Path("/store")).path_for(value)


@given(st.from_regex(VALID_HASH, fullmatch=True))
def test_every_hash_maps_to_one_directory(value: str) -> None:
    assert validate_identity_hash(value) == value
    assert validate_artifact_key(value) == value
    assert ArtifactStore(Path("/store")).path_for(value) == Path("/store") / value


@given(st.from_regex(VALID_BOUND_KEY, fullmatch=True).filter(lambda k: len(k.split("/")[0]) <= 63))
def test_every_bound_key_maps_to_one_directory_two_deep(value: str) -> None:
    assert validate_artifact_key(value) == value
    path = ArtifactStore(Path("/store")).path_for(value)
    assert path.parent.parent == Path("/store")
    assert path == Path("/store") / value.split("/")[0] / value.split("/")[1]


@pytest.mark.parametrize(
    "value",
    [
        "../../etc/passwd",
        "0123456789abcdef\n",
        "0123456789ABCDEF",
        "0123456789abcdef/x",
        "",
        "../x",
        "a/../../b",
        f"../{CHECKPOINT_UID}",
        f"{NAMESPACE}/..",
        f"{NAMESPACE}/../{CHECKPOINT_UID}",
        f"{NAMESPACE.upper()}/{CHECKPOINT_UID}",
        f"{NAMESPACE}/{CHECKPOINT_UID.upper()}",
        f"/{NAMESPACE}/{CHECKPOINT_UID}",
        f"/{CHECKPOINT_UID}",
        f"{NAMESPACE}//{CHECKPOINT_UID}",
        f"{NAMESPACE}/{CHECKPOINT_UID}/",
        f"{NAMESPACE}/{CHECKPOINT_UID}/x",
        f"{NAMESPACE}/{CHECKPOINT_UID}\n",
        f"./{CHECKPOINT_UID}",
        f"-a/{CHECKPOINT_UID}",
        f"{'a' * 64}/{CHECKPOINT_UID}",
        f"{NAMESPACE}/{CHECKPOINT_UID[:-1]}",
        f"{NAMESPACE}\\{CHECKPOINT_UID}",
        f"{NAMESPACE}/{{{CHECKPOINT_UID}}}",
    ],
)
def test_path_like_keys_refused(value: str) -> None:
    with pytest.raises(ValueError, match="invalid artifact key"):
        ArtifactStore(Path("/store")).path_for(value)


@pytest.mark.parametrize("value", [None, 7, b"0123456789abcdef", ["a", "b"]])
def test_keys_that_are_no_strings_refused(value: object) -> None:
    with pytest.raises(ValueError, match="invalid artifact key"):
        validate_artifact_key(value)


def test_artifact_key_joins_namespace_and_uid() -> None:
    assert artifact_key(NAMESPACE, CHECKPOINT_UID) == KEY == BINDING.key
    assert validate_artifact_key(KEY) == KEY
    assert artifact_key("a" * 63, CHECKPOINT_UID) == f"{'a' * 63}/{CHECKPOINT_UID}"
    with pytest.raises(ValueError, match=r"invalid namespace '\.\.': need a DNS-1123 label"):
        artifact_key("..", CHECKPOINT_UID)
    with pytest.raises(ValueError, match="invalid checkpoint uid 'x/y': need a lowercase RFC 4122 UUID"):
        artifact_key(NAMESPACE, "x/y")
    # The message says which part is wrong, not only that the key is.
    with pytest.raises(ValueError, match=r"invalid artifact key 'Tenant/.*: invalid namespace 'Tenant'"):
        validate_artifact_key(f"Tenant/{CHECKPOINT_UID}")


# ------------------------------------------------------------------ the seal


def test_sealed_manifest_round_trip_and_documented_digest() -> None:
    m = load(sealed_dict())
    assert m.digest is not None
    assert m.binding == BINDING
    assert m.key == KEY
    assert Manifest.from_json(m.to_json()) == m
    # The rule the module docstring gives other implementations, computed here by hand.
    written = json.loads(m.to_json())
    del written["digest"]
    text = json.dumps(written, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == m.digest == m.compute_digest()


def test_sealed_covers_non_ascii_text() -> None:
    raw = sealed_dict(extra={"note": "Grüße 😀"})
    m = load(raw)
    assert m.extra["note"] == "Grüße 😀"
    assert Manifest.from_json(m.to_json()) == m
    # Written with \u escapes, it is the same content and the same seal.
    assert Manifest.from_json(json.dumps(raw, ensure_ascii=True)) == m
    raw["extra"]["note"] = "Grüsse 😀"
    with pytest.raises(ArtifactError, match="was changed after it was sealed"):
        Manifest.from_json(json.dumps(raw))


def test_lone_surrogate_is_reported_not_raised() -> None:
    raw = sealed_dict()
    text = json.dumps(raw).replace('"node-a"', '"node-\\ud83d"')
    with pytest.raises(ArtifactError, match="text that is not valid Unicode"):
        Manifest.from_json(text)


def test_unsealed_manifest_seals_itself() -> None:
    raw = manifest_dict(format_version=FORMAT_VERSION)
    m = Manifest.model_validate(raw)
    assert m.digest is None
    sealed = m.sealed()
    assert sealed.digest == canonical_digest(json.loads(m.to_json()))
    assert Manifest.from_json(sealed.to_json()) == sealed


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("extra", "control_dir"), "/snapshot/controm"),
        (("source_node",), "node-b"),
        (("files", 0, "size"), 11),
        (("binding", "namespace"), "tenant-b"),
        (("binding", "source_pod"), "attacker"),
        (("identity_hash",), "0000000000000000"),
        (("format_version",), 2),
    ],
)
def test_any_edit_of_a_sealed_manifest_is_refused(path: tuple[str | int, ...], value: object) -> None:
    raw = sealed_dict(extra={"control_dir": "/snapshot/control"})
    load(raw)
    target: Any = raw
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    with pytest.raises(ArtifactError) as err:
        Manifest.from_json(json.dumps(raw), source="/store/x/manifest.json")
    assert str(err.value).startswith(
        f"/store/x/manifest.json was changed after it was sealed: it records digest {raw['digest']}, "
        "its content hashes to "
    )


def test_one_byte_edit_of_the_file_is_refused() -> None:
    data = load(sealed_dict(extra={"control_dir": "/snapshot/control"})).to_json()
    edited = data.replace(b'"/snapshot/control"', b'"/snapshot/contro1"')
    assert len(edited) == len(data)
    assert edited != data
    with pytest.raises(ArtifactError, match=r"^manifest\.json was changed after it was sealed: "):
        Manifest.from_json(edited)


def test_whitespace_and_key_order_are_not_content() -> None:
    raw = sealed_dict()
    compact = json.dumps(dict(reversed(list(raw.items()))), separators=(",", ":"))
    assert Manifest.from_json(compact) == load(raw)


def test_sealed_format_needs_a_digest() -> None:
    version = FORMAT_VERSION
    raw = manifest_dict(format_version=version)
    with pytest.raises(ArtifactError) as err:
        Manifest.from_json(json.dumps(raw))
    assert str(err.value) == f"manifest.json has no digest: a format_version {version} manifest is sealed"


@pytest.mark.parametrize("digest", ["b" * 64, "not hex", 42])
def test_wrong_or_malformed_digest_is_refused(digest: object) -> None:
    raw = {**sealed_dict(), "digest": digest}
    with pytest.raises(ArtifactError, match="was changed after it was sealed"):
        Manifest.from_json(json.dumps(raw))


def test_format_2_manifest_without_digest_still_loads() -> None:
    m = load(manifest_dict(format_version=2))
    assert (m.format_version, m.digest, m.binding, m.key) == (2, None, None, HASH)
    assert Manifest.from_json(m.to_json()) == m


def test_format_2_has_no_binding_or_digest() -> None:
    # A sealed, bound manifest passed off as format 2 (to dodge the seal) breaks its seal.
    raw = {**sealed_dict(), "format_version": 2}
    with pytest.raises(ArtifactError, match="was changed after it was sealed"):
        Manifest.from_json(json.dumps(raw))
    # Without the digest, the binding gives it away.
    del raw["digest"]
    with pytest.raises(
        ArtifactError, match=re.escape("format_version 2 has no binding (format_version 3 has)")
    ):
        Manifest.from_json(json.dumps(raw))
    unbound = manifest_dict(format_version=2)
    with pytest.raises(
        ArtifactError, match=re.escape("format_version 2 has no digest (format_version 3 has)")
    ):
        Manifest.from_json(json.dumps({**unbound, "digest": canonical_digest(unbound)}))


# ------------------------------------------------------------------ the binding


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"namespace": "Tenant-A"}, "binding.namespace: invalid namespace 'Tenant-A'"),
        ({"namespace": "a" * 64}, "binding.namespace: invalid namespace"),
        ({"namespace": ""}, "binding.namespace: invalid namespace ''"),
        ({"checkpoint_uid": "not-a-uid"}, "binding.checkpoint_uid: invalid checkpoint uid 'not-a-uid'"),
        ({"checkpoint_uid": CHECKPOINT_UID.upper()}, "binding.checkpoint_uid: invalid checkpoint uid"),
        ({"checkpoint_name": ""}, "binding.checkpoint_name"),
        ({"source_pod": ""}, "binding.source_pod"),
        ({"source_pod_uid": ""}, "binding.source_pod_uid"),
        ({"source_pod": 5}, "binding.source_pod"),
        ({"extra_field": "x"}, "binding.extra_field: Extra inputs are not permitted"),
    ],
)
def test_binding_validation(changes: dict[str, Any], message: str) -> None:
    raw = manifest_dict(format_version=FORMAT_VERSION, binding={**BINDING.model_dump(), **changes})
    with pytest.raises(ArtifactError, match=re.escape(message)):
        load(raw)


def test_binding_fields_are_all_required() -> None:
    for field in Binding.model_fields:
        raw = BINDING.model_dump()
        del raw[field]
        with pytest.raises(ArtifactError, match=f"binding.{field}: Field required"):
            load(manifest_dict(format_version=FORMAT_VERSION, binding=raw))


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
