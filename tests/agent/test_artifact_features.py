"""An artifact that needs a format feature (or a format version) the agent does not read is refused before
anything of it is read or run: no CRIU, no runtime, the feature or version named in the message that
becomes the pod's failed status."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import ArtifactRefused, Executor
from dynamo_snapshot.agent.runtime.base import Runtime
from dynamo_snapshot.agent.weights import weights_features
from dynamo_snapshot.artifact import FORMAT_VERSION, ArtifactStore, ArtifactWriter
from dynamo_snapshot.artifact import manifest as manifest_module
from dynamo_snapshot.artifact.manifest import (
    FEATURE_COMPRESSED_PAGES,
    FEATURE_SPLIT_NIBBLE_WEIGHTS,
    SUPPORTED_FEATURES,
    canonical_digest,
)
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.workload.weights import (
    ENCODING_SPLIT_NIBBLE,
    Encoding,
    WeightsHeader,
    data_digest,
    plan_layout,
)
from tests.artifact.helpers import read_manifest, write_manifest

HASH = "0123456789abcdef"
SHA = "a" * 64


class Untouchable:
    """A runtime or CRIU that fails the test on any use but naming itself."""

    name = "process"

    def __getattr__(self, attr: str) -> Any:
        raise AssertionError(f"{attr} used for a refused artifact")


async def _executor(tmp_path: Path, features: list[str]) -> Executor:
    store = ArtifactStore(tmp_path / "store")
    with ArtifactWriter(store, HASH) as writer:
        (writer.directory / "criu").mkdir()
        (writer.directory / "criu" / "core-1.img").write_bytes(b"core")
        await writer.publish(criu_version="4.1.1", source_node="node-a", features=features)
    untouchable = Untouchable()
    return Executor(
        cast(Runtime, untouchable),
        store,
        cast(Criu, untouchable),
        AgentConfig(node_name="node-a"),
        cuda=None,
        gpus=None,
    )


async def test_an_unknown_feature_is_refused_up_front(tmp_path: Path) -> None:
    executor = await _executor(tmp_path, [FEATURE_COMPRESSED_PAGES])
    artifact_dir = executor.store.path_for(HASH)
    raw = read_manifest(artifact_dir)
    raw["features"] = [FEATURE_COMPRESSED_PAGES, "holographic-pages"]
    write_manifest(artifact_dir, raw, reseal=True)
    with pytest.raises(ArtifactRefused) as refused:
        await executor.restore("restored", HASH, manifest_digest=canonical_digest(raw))
    assert str(refused.value).startswith(
        f"artifact {HASH} refused: it needs format feature(s) this reader does not support: holographic-pages"
    )


async def test_an_older_reader_refuses_a_feature_it_predates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = await _executor(tmp_path, [FEATURE_COMPRESSED_PAGES])
    monkeypatch.setattr(
        manifest_module, "SUPPORTED_FEATURES", SUPPORTED_FEATURES - {FEATURE_COMPRESSED_PAGES}
    )
    with pytest.raises(ArtifactRefused, match=r"does not support: compressed-pages \(format_version 4;"):
        await executor.restore("restored", HASH)


async def test_an_older_reader_refuses_a_newer_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = await _executor(tmp_path, [])
    older = FORMAT_VERSION - 1
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", older)
    message = f"format_version {FORMAT_VERSION} is newer than supported {older}"
    with pytest.raises(ArtifactRefused, match=message):
        await executor.restore("restored", HASH)


def test_encoded_weights_files_need_their_feature(tmp_path: Path) -> None:
    def header(encoding: Encoding | None) -> WeightsHeader:
        specs, _ = plan_layout([("w", "uint8", (8192,), 8192)], 256)
        return WeightsHeader(
            tensors=tuple(specs),
            data_bytes=8192,
            device_bytes=8192,
            chunk_bytes=4096,
            chunk_sha256=(SHA, SHA),
            data_digest=data_digest([SHA, SHA]),
            encoding=encoding,
        )

    plain, nibble = tmp_path / "plain.dsw", tmp_path / "nibble.dsw"
    plain.write_bytes(header(None).encode() + bytes(8192))
    nibble.write_bytes(header(Encoding(ENCODING_SPLIT_NIBBLE, (-1, -1))).encode() + bytes(8192))
    assert weights_features([plain]) == set()
    assert weights_features([plain, nibble]) == {FEATURE_SPLIT_NIBBLE_WEIGHTS}
