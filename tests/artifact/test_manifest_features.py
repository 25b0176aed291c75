"""The format features a manifest lists (from format 4): recorded by the writer, refused by a reader that
does not know one, implied for manifests of earlier formats, and part of the sealed content."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path

import pytest

from dynamo_snapshot.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    ArtifactStore,
    ArtifactWriter,
    Manifest,
    PublishResult,
)
from dynamo_snapshot.artifact import manifest as manifest_module
from dynamo_snapshot.artifact.manifest import (
    FEATURE_COMPRESSED_PAGES,
    FEATURE_ROOTFS_DIFF,
    FEATURE_SPLIT_NIBBLE_WEIGHTS,
    SUPPORTED_FEATURES,
    canonical_digest,
)

from .helpers import HASH, as_format, read_manifest, sample_files, stage, write_manifest


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


async def publish(
    store: ArtifactStore, files: dict[str, bytes], features: Collection[str] = ()
) -> PublishResult:
    with ArtifactWriter(store, HASH) as writer:
        stage(writer.directory, files)
        return await writer.publish(criu_version="4.1.1", source_node="node-a", features=features)


async def test_the_writer_records_the_features_used_sorted(store: ArtifactStore) -> None:
    used = [FEATURE_ROOTFS_DIFF, FEATURE_COMPRESSED_PAGES, FEATURE_ROOTFS_DIFF]
    result = await publish(store, sample_files(), features=used)
    assert result.artifact.manifest.features == [FEATURE_COMPRESSED_PAGES, FEATURE_ROOTFS_DIFF]
    assert read_manifest(store.path_for(HASH))["features"] == [FEATURE_COMPRESSED_PAGES, FEATURE_ROOTFS_DIFF]
    store.open(HASH).check_features()


async def test_an_artifact_without_optional_formats_lists_none(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    artifact = store.open(HASH)
    assert (artifact.manifest.format_version, artifact.manifest.features) == (FORMAT_VERSION, [])
    assert artifact.manifest.required_features == frozenset()


async def test_the_writer_refuses_a_feature_it_cannot_read(store: ArtifactStore) -> None:
    with pytest.raises(ValueError, match="unknown artifact feature"):
        await publish(store, sample_files(), features=["holographic-pages"])


async def test_an_unknown_feature_is_refused_and_named(store: ArtifactStore) -> None:
    await publish(store, sample_files(), features=[FEATURE_COMPRESSED_PAGES])
    raw = read_manifest(store.path_for(HASH))
    raw["features"] = sorted([*raw["features"], "holographic-pages"])
    write_manifest(store.path_for(HASH), raw, reseal=True)
    artifact = store.open(HASH)  # still readable as a manifest: tools can show it
    with pytest.raises(ArtifactError, match=r"does not support: holographic-pages \(format_version 4"):
        artifact.check_features()


async def test_an_older_reader_refuses_a_feature_it_predates(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish(store, sample_files(), features=[FEATURE_SPLIT_NIBBLE_WEIGHTS])
    monkeypatch.setattr(
        manifest_module, "SUPPORTED_FEATURES", SUPPORTED_FEATURES - {FEATURE_SPLIT_NIBBLE_WEIGHTS}
    )
    with pytest.raises(ArtifactError, match="does not support: split-nibble-weights "):
        store.open(HASH).check_features()
    # The same, through the parameter.
    monkeypatch.undo()
    with pytest.raises(ArtifactError, match="does not support: split-nibble-weights "):
        store.open(HASH).check_features(known=frozenset())


async def test_a_previous_format_manifest_still_reads(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    previous = FORMAT_VERSION - 1
    write_manifest(
        store.path_for(HASH), as_format(read_manifest(store.path_for(HASH)), previous), reseal=True
    )
    artifact = store.open(HASH)
    m = artifact.manifest
    assert (m.format_version, m.features) == (previous, None)
    # Its writer could use every feature of its time without listing it: all are implied, all known.
    assert m.required_features == SUPPORTED_FEATURES
    artifact.check_features()
    artifact.verify(expect_hash=HASH)
    # The new member stays out of an older manifest's content, so its seal is unchanged.
    assert "features" not in json.loads(m.to_json())
    assert m.compute_digest() == m.digest


async def test_a_reader_without_a_feature_refuses_a_previous_format_artifact(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish(store, sample_files())
    write_manifest(store.path_for(HASH), as_format(read_manifest(store.path_for(HASH)), 3), reseal=True)
    monkeypatch.setattr(manifest_module, "SUPPORTED_FEATURES", SUPPORTED_FEATURES - {FEATURE_ROOTFS_DIFF})
    with pytest.raises(ArtifactError, match=r"does not support: rootfs-diff \(format_version 3;"):
        store.open(HASH).check_features()


def _raw(**changes: object) -> dict[str, object]:
    raw = json.loads((Manifest.model_validate(_base()).sealed()).to_json())
    raw.update(changes)
    raw.pop("digest", None)
    return {**raw, "digest": canonical_digest(raw)}


def _base() -> dict[str, object]:
    return {
        "identity_hash": HASH,
        "created_at": "2026-11-29T16:00:00Z",
        "source_node": "node-a",
        "criu_version": "4.1.1",
        "agent_version": "0.1.0",
        "files": [],
        "features": [],
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"features": None}, "a format_version 4 manifest lists its features"),
        ({"features": ["Compressed_Pages"]}, "feature names are lowercase words joined by '-'"),
        ({"features": ["rootfs-diff", "compressed-pages"]}, "features must be sorted, each listed once"),
        ({"features": ["rootfs-diff", "rootfs-diff"]}, "features must be sorted, each listed once"),
        ({"format_version": 3}, "format_version 3 has no features (format_version 4 has)"),
    ],
)
def test_a_malformed_feature_list_is_refused(changes: dict[str, object], message: str) -> None:
    raw = _raw(**changes)
    if raw.get("features") is None:
        del raw["features"]
        raw = {**raw, "digest": canonical_digest(raw)}
    with pytest.raises(ArtifactError, match=re.escape(message)):
        Manifest.from_json(json.dumps(raw))
