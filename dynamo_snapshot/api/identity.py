"""The checkpoint identity and its hash.

The identity names the runtime state a checkpoint captures; two workers with the same identity hash may
restore each other's checkpoint.  The hash must equal the one Dynamo's Go operator computes
(ai-dynamo/dynamo, deploy/operator/internal/checkpoint/hash.go: ``ComputeIdentityHash``), because both
sides label and look up DynamoCheckpoints by it.  That function normalises the identity (parallel sizes
0 -> 1), marshals this struct with ``encoding/json`` and keeps the first 16 hex digits of its SHA-256::

    type normalizedIdentity struct {
        Model                string            `json:"model"`
        BackendFramework     string            `json:"backendFramework"`
        DynamoVersion        string            `json:"dynamoVersion,omitempty"`
        TensorParallelSize   int32             `json:"tensorParallelSize"`
        PipelineParallelSize int32             `json:"pipelineParallelSize"`
        Dtype                string            `json:"dtype,omitempty"`
        MaxModelLen          int32             `json:"maxModelLen,omitempty"`
        ExtraParameters      map[string]string `json:"extraParameters,omitempty"`
    }

That function takes any identity, so the hash does too: a mapping is hashed with Go's types and no
other checks (zero or negative sizes, strings that are not UTF-8).  The model, and the CRD schema
generated from it, admit 0 for the three sizes: they are ``omitempty`` int32 fields in Dynamo's Go
types, where 0 cannot be told from unset, and 0 hashes like unset.  Negative sizes are refused, as
Dynamo's CRD refuses them; its minimum for all three is 1, so this schema is more lenient than
Dynamo's about 0 only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import Field

from dynamo_snapshot.api.gojson import go_quote, go_string_map
from dynamo_snapshot.api.kube import INT32_MAX, NonNegativeInt32, StrictKubeModel

__all__ = [
    "IDENTITY_HASH_LENGTH",
    "BackendFramework",
    "CheckpointIdentity",
    "compute_identity_hash",
    "identity_hash_payload",
]

IDENTITY_HASH_LENGTH = 16

_FIELDS = (
    "model",
    "backendFramework",
    "dynamoVersion",
    "tensorParallelSize",
    "pipelineParallelSize",
    "dtype",
    "maxModelLen",
    "extraParameters",
)


class BackendFramework(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


class CheckpointIdentity(StrictKubeModel):
    """The inputs that decide whether two workers can share a checkpoint; immutable once set."""

    model: str = Field(min_length=1, description='Model identifier, e.g. "meta-llama/Llama-3-8B".')
    backend_framework: BackendFramework = Field(description="Runtime framework: vllm, sglang or trtllm.")
    dynamo_version: str | None = Field(
        default=None,
        description="Dynamo version. Omitted from the hash when empty, so checkpoints survive upgrades.",
    )
    tensor_parallel_size: NonNegativeInt32 = Field(
        default=1, description="Tensor parallel size; 0 counts as 1, as in Dynamo's hash."
    )
    pipeline_parallel_size: NonNegativeInt32 = Field(
        default=1, description="Pipeline parallel size; 0 counts as 1, as in Dynamo's hash."
    )
    dtype: str | None = Field(default=None, description="Data type, e.g. bfloat16, float16, fp8.")
    max_model_len: NonNegativeInt32 | None = Field(
        default=None, description="Maximum sequence length; 0 is the same as unset."
    )
    extra_parameters: dict[str, str] | None = Field(
        default=None, description="Further framework-specific parameters that change the runtime state."
    )

    def compute_hash(self) -> str:
        return compute_identity_hash(self)


def _string(fields: Mapping[str, Any], key: str) -> str:
    value = fields.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"identity {key} must be a string, not {type(value).__name__}")
    return value


def _int32(fields: Mapping[str, Any], key: str) -> int:
    value = fields.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"identity {key} must be an integer, not {type(value).__name__}")
    if not -(2**31) <= value <= INT32_MAX:
        raise ValueError(f"identity {key}={value} does not fit Go's int32")
    return value


def _wire_fields(identity: CheckpointIdentity | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(identity, CheckpointIdentity):
        return identity.model_dump(mode="json", by_alias=True)
    unknown = sorted(set(identity) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown checkpoint identity field(s): {', '.join(unknown)}")
    return identity


def identity_hash_payload(identity: CheckpointIdentity | Mapping[str, Any]) -> bytes:
    """The exact bytes Dynamo's operator hashes: Go ``json.Marshal`` of the normalised identity.

    A mapping is read with the API's camelCase keys and, like Go, is not validated beyond types, so
    zero or negative sizes hash the way Dynamo hashes them.
    """
    fields = _wire_fields(identity)
    tensor_parallel = _int32(fields, "tensorParallelSize") or 1
    pipeline_parallel = _int32(fields, "pipelineParallelSize") or 1
    max_model_len = _int32(fields, "maxModelLen")
    dynamo_version = _string(fields, "dynamoVersion")
    dtype = _string(fields, "dtype")
    extra = fields.get("extraParameters") or {}
    if not isinstance(extra, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in extra.items()
    ):
        raise TypeError("identity extraParameters must map strings to strings")

    parts = [
        b'"model":' + go_quote(_string(fields, "model")),
        b'"backendFramework":' + go_quote(_string(fields, "backendFramework")),
    ]
    if dynamo_version:
        parts.append(b'"dynamoVersion":' + go_quote(dynamo_version))
    parts.append(b'"tensorParallelSize":%d' % tensor_parallel)
    parts.append(b'"pipelineParallelSize":%d' % pipeline_parallel)
    if dtype:
        parts.append(b'"dtype":' + go_quote(dtype))
    if max_model_len:
        parts.append(b'"maxModelLen":%d' % max_model_len)
    if extra:
        parts.append(b'"extraParameters":' + go_string_map(extra))
    return b"{" + b",".join(parts) + b"}"


def compute_identity_hash(identity: CheckpointIdentity | Mapping[str, Any]) -> str:
    """The 16 lowercase hex digit identity hash, equal to Dynamo's ``ComputeIdentityHash``."""
    digest = hashlib.sha256(identity_hash_payload(identity)).hexdigest()
    return digest[:IDENTITY_HASH_LENGTH]
