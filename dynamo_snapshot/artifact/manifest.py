"""The versioned manifest (``manifest.json``) that describes and seals an artifact's files.

From format version 3 the manifest seals itself too: its ``digest`` member is the lowercase hex SHA-256 of
the UTF-8 bytes of ::

    json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

where ``obj`` is the JSON object in ``manifest.json`` without its ``digest`` member (Python's ``json``
writes numbers as their shortest round-trip form; another implementation must write them the same way).
A format-3 manifest without a digest, or whose content no longer hashes to it, is refused; format-2
manifests have none and still load (CLI artifacts of older agents). The digest is not a signature: it
catches any change made after publication (an edit, a damaged block), and it names the one artifact a
checkpoint recorded, so a restore can insist on exactly that one.

Format 3 also binds an artifact made for a Kubernetes checkpoint to it (``Binding``: namespace,
checkpoint name and UID, source pod); CLI artifacts have no binding.

From format version 4 the manifest lists the optional formats its files use (``features``), each of
which a reader must know to restore the artifact: ``compressed-pages`` (CRIU pages images stored packed,
see criu.packed), ``split-nibble-weights`` (carried weights files in that encoding), ``rootfs-diff`` (the
container's writable layer, applied into the restore container). A reader refuses an artifact that needs
a feature it does not know, before it reads anything else, naming the feature; a new optional format is
then a new feature name, not a new format version. The list is part of the sealed content.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from dynamo_snapshot.api.identity import IDENTITY_HASH_LENGTH, CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact.errors import ArtifactError
from dynamo_snapshot.fileio import ALIGN, chunk_count

__all__ = [
    "CHECKPOINT_UID_PATTERN",
    "FEATURE_COMPRESSED_PAGES",
    "FEATURE_ROOTFS_DIFF",
    "FEATURE_SPLIT_NIBBLE_WEIGHTS",
    "FORMAT_VERSION",
    "IDENTITY_HASH_PATTERN",
    "MANIFEST_NAME",
    "NAMESPACE_MAX_LENGTH",
    "NAMESPACE_PATTERN",
    "SUPPORTED_FEATURES",
    "Binding",
    "FileEntry",
    "GpuInfo",
    "Manifest",
    "canonical_digest",
    "supported_features",
    "validate_checkpoint_uid",
    "validate_identity_hash",
    "validate_namespace",
    "validate_relative_path",
]

# 2: a file may be sealed as per-chunk digests (``chunk_bytes``/``chunks``) instead of one ``sha256``.
# 3: the manifest's own ``digest``, and the ``binding`` to a Kubernetes checkpoint.
# 4: ``features``, the optional formats a reader must know.
FORMAT_VERSION = 4
_FIRST_CHUNKED_VERSION = 2
_FIRST_SEALED_VERSION = 3
_FIRST_FEATURES_VERSION = 4
FEATURE_COMPRESSED_PAGES = "compressed-pages"
FEATURE_SPLIT_NIBBLE_WEIGHTS = "split-nibble-weights"
FEATURE_ROOTFS_DIFF = "rootfs-diff"
# What this version reads (and so may write). Read at call time, so a test can stand for an older reader.
SUPPORTED_FEATURES: frozenset[str] = frozenset(
    {FEATURE_COMPRESSED_PAGES, FEATURE_SPLIT_NIBBLE_WEIGHTS, FEATURE_ROOTFS_DIFF}
)
# Before format 4 a manifest listed no features, though its writer could already produce these three
# without saying so; each is taken as needed. Every reader of format 4 reads all three, so such artifacts
# still restore; a reader that one day drops one of them refuses them rather than misread them.
_UNLISTED_FEATURES: frozenset[str] = frozenset(
    {FEATURE_COMPRESSED_PAGES, FEATURE_SPLIT_NIBBLE_WEIGHTS, FEATURE_ROOTFS_DIFF}
)
_FEATURE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
MANIFEST_NAME = "manifest.json"
DIGEST_FIELD = "digest"
IDENTITY_HASH_PATTERN = rf"^[0-9a-f]{{{IDENTITY_HASH_LENGTH}}}$"
_HASH = re.compile(IDENTITY_HASH_PATTERN)
# A Kubernetes namespace name: an RFC 1123 (DNS) label.
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAMESPACE_MAX_LENGTH = 63
_NAMESPACE = re.compile(NAMESPACE_PATTERN)
# metadata.uid as the apiserver writes it: an RFC 4122 UUID in its lowercase 8-4-4-4-12 text form.
CHECKPOINT_UID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_UID = re.compile(CHECKPOINT_UID_PATTERN)
_SHA256 = r"^[0-9a-f]{64}$"
_MAX_PATH = 4096

StrictNonNegative = Annotated[int, Field(strict=True, ge=0)]
StrictPositive = Annotated[int, Field(strict=True, ge=1)]
Sha256Hex = Annotated[str, Field(strict=True, pattern=_SHA256)]


def supported_features() -> frozenset[str]:
    """The features this version reads: ``SUPPORTED_FEATURES`` as it stands now."""
    return SUPPORTED_FEATURES


def validate_identity_hash(value: object) -> str:
    """``value`` if it is an identity hash (16 lowercase hex digits), else ``ValueError``.

    The hash is the only thing that becomes a path in a store, so this is the gate against traversal.
    """
    # fullmatch, not match: "$" would accept a trailing newline.
    if not isinstance(value, str) or not _HASH.fullmatch(value):
        raise ValueError(f"invalid identity hash {value!r}: need {IDENTITY_HASH_LENGTH} lowercase hex digits")
    return value


def validate_namespace(value: object) -> str:
    """``value`` if it is a Kubernetes namespace name (a DNS-1123 label), else ``ValueError``."""
    if not isinstance(value, str) or len(value) > NAMESPACE_MAX_LENGTH or not _NAMESPACE.fullmatch(value):
        raise ValueError(
            f"invalid namespace {value!r}: need a DNS-1123 label (at most {NAMESPACE_MAX_LENGTH} lowercase "
            "letters, digits and '-', starting and ending with a letter or digit)"
        )
    return value


def validate_checkpoint_uid(value: object) -> str:
    """``value`` if it is a Kubernetes object UID (a lowercase RFC 4122 UUID), else ``ValueError``."""
    if not isinstance(value, str) or not _UID.fullmatch(value):
        raise ValueError(
            f"invalid checkpoint uid {value!r}: need a lowercase RFC 4122 UUID (8-4-4-4-12 hex digits)"
        )
    return value


def canonical_digest(manifest: Mapping[str, Any]) -> str:
    """The seal of a manifest given as its JSON object: see the module docstring. ``ValueError`` for an
    object that has no canonical UTF-8 form (a lone surrogate, a non-finite number)."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        data = text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"manifest has text that is not valid Unicode: {e.reason}") from None
    return hashlib.sha256(data).hexdigest()


def validate_relative_path(value: str) -> str:
    """``value`` if it is a plain relative POSIX path that stays inside the artifact directory."""
    if not value:
        raise ValueError("file path is empty")
    if len(value) > _MAX_PATH:
        raise ValueError(f"file path is longer than {_MAX_PATH} characters")
    if "\0" in value or "\\" in value:
        raise ValueError(f"file path {value!r} contains a NUL or backslash")
    if value.startswith("/"):
        raise ValueError(f"file path {value!r} is absolute")
    parts = value.split("/")
    if ".." in parts:
        raise ValueError(f"file path {value!r} contains '..'")
    if "" in parts or "." in parts:
        raise ValueError(f"file path {value!r} is not normalised (empty or '.' component)")
    if value == MANIFEST_NAME:
        raise ValueError(f"file path {value!r} is reserved for the manifest")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Model):
    """One sealed file: its whole-content ``sha256``, or ``chunks`` (one SHA-256 per ``chunk_bytes``)."""

    path: str = Field(description="Relative POSIX path inside the artifact directory.")
    size: StrictNonNegative = Field(description="Size in bytes.")
    sha256: Sha256Hex | None = Field(default=None, description="Lowercase hex SHA-256 of the content.")
    chunk_bytes: StrictPositive | None = Field(
        default=None, description="Size of each chunk in bytes (a multiple of 4096); with chunks."
    )
    chunks: list[Sha256Hex] | None = Field(
        default=None,
        description="Lowercase hex SHA-256 of each consecutive chunk_bytes piece, the last one shorter.",
    )

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        return validate_relative_path(v)

    @model_validator(mode="after")
    def _one_digest(self) -> FileEntry:
        problem = _digest_problem(self)
        if problem:
            raise ValueError(f"{self.path}: {problem}")
        return self

    @property
    def chunked(self) -> bool:
        return self.chunks is not None


def _digest_problem(entry: FileEntry) -> str | None:
    if entry.sha256 is not None and entry.chunks is not None:
        return "has both sha256 and chunks; need exactly one"
    if entry.chunks is None:
        if entry.sha256 is None:
            return "has neither sha256 nor chunks"
        if entry.chunk_bytes is not None:
            return "chunk_bytes without chunks"
        return None
    if entry.chunk_bytes is None:
        return "chunks without chunk_bytes"
    if entry.chunk_bytes % ALIGN:
        return f"chunk_bytes {entry.chunk_bytes} is not a multiple of {ALIGN}"
    want = chunk_count(entry.size, entry.chunk_bytes)
    if len(entry.chunks) != want:
        have = len(entry.chunks)
        return f"{have} chunks for {entry.size} bytes in {entry.chunk_bytes}-byte chunks; need {want}"
    return None


class GpuInfo(_Model):
    """The GPUs a checkpoint was taken on, or those a node offers (then only some fields are known)."""

    product: str = Field(min_length=1, description='nvidia.com/gpu.product, e.g. "NVIDIA-H200".')
    driver_version: str | None = Field(default=None, description='Full driver version, e.g. "570.133.20".')
    # A string like the node label and the DynamoCheckpoint status it is compared with.
    cuda_driver_major: str = Field(
        pattern=r"^[0-9]+$", description='nvidia.com/cuda.driver.major, e.g. "570".'
    )
    count: StrictPositive = Field(description="GPUs used by the checkpointed worker.")
    uuids: list[str] = Field(default_factory=list, description="GPU UUIDs, one per GPU when known.")
    memory_mib: StrictNonNegative | None = Field(default=None, description="Memory per GPU in MiB.")

    @model_validator(mode="after")
    def _uuids_match_count(self) -> GpuInfo:
        if self.uuids and len(self.uuids) != self.count:
            raise ValueError(f"{len(self.uuids)} GPU uuids for a count of {self.count}")
        if len(set(self.uuids)) != len(self.uuids):
            raise ValueError("GPU uuids repeat")
        return self


class Binding(_Model):
    """The Kubernetes checkpoint an artifact was taken for, and the pod it was taken from: the artifact
    belongs to that namespace and checkpoint alone (``<namespace>/<checkpoint uid>`` in the store)."""

    namespace: str = Field(description="The DynamoCheckpoint's namespace (a DNS-1123 label).")
    checkpoint_name: str = Field(min_length=1, description="The DynamoCheckpoint's name.")
    checkpoint_uid: str = Field(description="The DynamoCheckpoint's metadata.uid.")
    source_pod: str = Field(min_length=1, description="Name of the pod the checkpoint was taken from.")
    source_pod_uid: str = Field(min_length=1, description="metadata.uid of that pod.")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return validate_namespace(v)

    @field_validator("checkpoint_uid")
    @classmethod
    def _uid(cls, v: str) -> str:
        return validate_checkpoint_uid(v)

    @property
    def key(self) -> str:
        """The store key of the artifact: ``<namespace>/<checkpoint uid>``."""
        return f"{self.namespace}/{self.checkpoint_uid}"


class Manifest(_Model):
    format_version: StrictPositive = FORMAT_VERSION
    identity_hash: str
    binding: Binding | None = Field(default=None, description="Absent for CLI checkpoints.")
    identity: CheckpointIdentity | None = Field(default=None, description="Absent for CLI checkpoints.")
    created_at: AwareDatetime
    source_node: str = Field(min_length=1)
    gpus: GpuInfo | None = Field(default=None, description="Absent for a CPU-only checkpoint.")
    criu_version: str = Field(min_length=1)
    agent_version: str = Field(min_length=1)
    files: list[FileEntry]
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per phase.")
    extra: dict[str, JsonValue] = Field(default_factory=dict, description="Caller's JSON data.")
    features: list[str] | None = Field(
        default=None,
        description="Optional formats the files use, which a reader must know (format 4; sorted, unique).",
    )
    digest: Sha256Hex | None = Field(
        default=None, description="SHA-256 of the manifest without this field (format 3); set by sealed()."
    )

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > FORMAT_VERSION:
            raise ValueError(f"manifest format_version {v} is newer than supported {FORMAT_VERSION}")
        return v

    @field_validator("identity_hash")
    @classmethod
    def _hash(cls, v: str) -> str:
        return validate_identity_hash(v)

    @field_validator("features")
    @classmethod
    def _feature_names(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        bad = [name for name in v if not _FEATURE.fullmatch(name)]
        if bad:
            raise ValueError(f"feature names are lowercase words joined by '-': {', '.join(map(repr, bad))}")
        if v != sorted(set(v)):
            raise ValueError("features must be sorted, each listed once")
        return v

    @field_validator("timings")
    @classmethod
    def _seconds(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, s in v.items() if not (math.isfinite(s) and s >= 0))
        if bad:
            raise ValueError(f"timings must be finite, non-negative seconds: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        paths = [f.path for f in self.files]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"files listed twice: {', '.join(dupes)}")
        chunked = [f.path for f in self.files if f.chunked]
        if chunked and self.format_version < _FIRST_CHUNKED_VERSION:
            raise ValueError(
                f"format_version {self.format_version} has no chunked files, "
                f"but these are chunked: {', '.join(chunked)}"
            )
        if self.format_version < _FIRST_SEALED_VERSION:
            new = [name for name in ("binding", DIGEST_FIELD) if getattr(self, name) is not None]
            if new:
                raise ValueError(
                    f"format_version {self.format_version} has no {' or '.join(new)} "
                    f"(format_version {_FIRST_SEALED_VERSION} has)"
                )
        if self.features is not None and self.format_version < _FIRST_FEATURES_VERSION:
            raise ValueError(
                f"format_version {self.format_version} has no features "
                f"(format_version {_FIRST_FEATURES_VERSION} has)"
            )
        if self.features is None and self.format_version >= _FIRST_FEATURES_VERSION:
            raise ValueError(f"a format_version {self.format_version} manifest lists its features (none: [])")
        if self.identity is not None:
            computed = compute_identity_hash(self.identity)
            if computed != self.identity_hash:
                raise ValueError(
                    f"identity hash mismatch: manifest says {self.identity_hash}, "
                    f"its identity hashes to {computed}"
                )
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def key(self) -> str:
        """The store key this manifest belongs under: its binding's ``<namespace>/<uid>``, else the hash."""
        return self.binding.key if self.binding is not None else self.identity_hash

    @property
    def required_features(self) -> frozenset[str]:
        """The optional formats a reader must know to restore this artifact."""
        return frozenset(self.features) if self.features is not None else _UNLISTED_FEATURES

    def unsupported_features(self, known: frozenset[str] | None = None) -> list[str]:
        """The features this artifact needs that a reader knowing ``known`` (default: this version's
        ``SUPPORTED_FEATURES``) does not; empty when it can read the artifact."""
        return sorted(self.required_features - (supported_features() if known is None else known))

    def compute_digest(self) -> str:
        """The digest of this manifest's content as ``to_json`` writes it (``digest`` aside): what
        ``sealed`` records. A manifest read from a file keeps the ``digest`` of that file's content, which
        another writer may have spelled differently (defaults left out, say)."""
        return canonical_digest(json.loads(self.model_dump_json(by_alias=True, exclude_none=True)))

    def sealed(self) -> Manifest:
        """This manifest with ``digest`` set to its content's digest."""
        return self.model_copy(update={DIGEST_FIELD: self.compute_digest()})

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate, raising ``ArtifactError`` with one line per problem.

        The format version is checked first, so a newer manifest is reported as that, not as a list
        of fields this version does not know; then the seal, so an edited manifest is reported as edited,
        whatever the edit broke.
        """
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{source} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ArtifactError(f"{source} must hold a JSON object, not {type(raw).__name__}")
        version = raw.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise ArtifactError(f"manifest format_version {version} is newer than supported {FORMAT_VERSION}")
        _check_seal(raw, source)
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ArtifactError([f"invalid {source}: {_describe(err)}" for err in e.errors()]) from e

    def compatibility(self, node_gpus: GpuInfo | None) -> list[str]:
        """Why a node with ``node_gpus`` cannot restore this checkpoint; empty when it can."""
        want = self.gpus
        if want is None:
            return []
        if node_gpus is None:
            return [f"node has no GPUs; the checkpoint needs {want.count} {want.product}"]
        problems = []
        if node_gpus.product != want.product:
            problems.append(f"GPU product {node_gpus.product} differs from the checkpoint's {want.product}")
        if node_gpus.cuda_driver_major != want.cuda_driver_major:
            problems.append(
                f"CUDA driver major {node_gpus.cuda_driver_major} differs from the checkpoint's "
                f"{want.cuda_driver_major}"
            )
        if node_gpus.count < want.count:
            problems.append(f"too few GPUs: node has {node_gpus.count}, the checkpoint needs {want.count}")
        return problems


def _check_seal(raw: dict[str, Any], source: str) -> None:
    """``ArtifactError`` unless a sealed manifest still hashes to its digest (and a format-3 one has one)."""
    version = raw.get("format_version")
    recorded = raw.get(DIGEST_FIELD)
    if recorded is None:
        if isinstance(version, int) and not isinstance(version, bool) and version >= _FIRST_SEALED_VERSION:
            raise ArtifactError(f"{source} has no digest: a format_version {version} manifest is sealed")
        return
    try:
        computed = canonical_digest(raw)
    except ValueError as e:
        raise ArtifactError(f"{source}: {e}") from None
    if recorded != computed:
        raise ArtifactError(
            f"{source} was changed after it was sealed: it records digest {recorded}, "
            f"its content hashes to {computed}"
        )


def _describe(err: ErrorDetails) -> str:
    loc = ".".join(str(part) for part in err["loc"]) or "manifest"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}"
