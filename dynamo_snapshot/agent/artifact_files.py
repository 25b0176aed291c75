"""Which of an artifact's files a restore needs, and when: the weights files its manifest says it
carries, what a fetch brings first (everything CRIU needs), and what a restore can take while it still
arrives (memory pages; weights files, for a worker whose loads wait for each byte)."""

from __future__ import annotations

import re

from pydantic import JsonValue

from dynamo_snapshot.agent.errors import ArtifactRefused
from dynamo_snapshot.agent.weights import CarriedWeights, WeightsPlacementError
from dynamo_snapshot.artifact import Artifact, Manifest
from dynamo_snapshot.criu.packed import PACKED_SUFFIX

__all__ = [
    "EARLY_LOAD_KEY",
    "READS_ARRIVING_KEY",
    "carried_weights",
    "fetched_first",
    "process_files",
    "streamed_pages",
    "streamed_weights",
]

# The manifest's extra: the worker waits for weights-verified, so a restore may signal it before then;
# and its loads wait for each byte of a weights file still arriving (protocol.FILE_WEIGHTS_ARRIVED).
EARLY_LOAD_KEY = "weightsEarlyLoad"
READS_ARRIVING_KEY = "weightsReadArriving"


def carried_weights(artifact: Artifact) -> list[CarriedWeights]:
    """The weights files the artifact carries beside the process images, as its manifest lists them."""
    try:
        return [CarriedWeights.from_json(w) for w in _list(artifact.manifest.extra, "weights")]
    except (ValueError, WeightsPlacementError) as e:
        raise ArtifactRefused(f"artifact {artifact.key} refused: {e}") from None


def _weight_files(manifest: Manifest) -> set[str]:
    return {CarriedWeights.from_json(w).file for w in _list(manifest.extra, "weights")}


def fetched_first(manifest: Manifest) -> list[str]:
    """What a restore needs before CRIU, so a fetch brings it first: every file but the carried weights
    (all of them where the weights list is unreadable: the restore refuses the artifact then)."""
    try:
        weights = _weight_files(manifest)
    except (ValueError, WeightsPlacementError):
        return [f.path for f in manifest.files]
    return [f.path for f in manifest.files if f.path not in weights]


_PAGES_IMAGE = re.compile(r"criu/pages-[0-9]+\.img")


def streamed_pages(manifest: Manifest) -> list[str]:
    """The memory pages images a restore can take while they arrive (criu.streamed_pages): all of them,
    none where any is stored compressed (those are unpacked whole first)."""
    pages = [f.path for f in manifest.files if _PAGES_IMAGE.fullmatch(f.path)]
    packed = any(f.path.startswith("criu/pages-") and f.path.endswith(PACKED_SUFFIX) for f in manifest.files)
    return [] if packed else pages


def streamed_weights(manifest: Manifest) -> list[str]:
    """The weights files a restore can put back while they arrive: all of them where the worker waits
    for the agent's verdict and reads each byte only once it is in; none otherwise."""
    extra = manifest.extra
    if extra.get(EARLY_LOAD_KEY) is not True or extra.get(READS_ARRIVING_KEY) is not True:
        return []
    try:
        return sorted(_weight_files(manifest))
    except (ValueError, WeightsPlacementError):
        return []


def process_files(artifact: Artifact, weights: list[CarriedWeights]) -> list[str]:
    """The artifact's files CRIU acts on: all but the weights."""
    weight_files = {w.file for w in weights}
    return [f.path for f in artifact.manifest.files if f.path not in weight_files]


def _list(extra: dict[str, JsonValue], key: str) -> list[JsonValue]:
    value = extra.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"manifest extra.{key} is not a list")
    return value
