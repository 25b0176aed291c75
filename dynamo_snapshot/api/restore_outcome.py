"""What a restore pod's ``nvidia.com/Restored`` condition says, read as NVIDIA Snapshot's restore-pod
contract reads it (its ``ClassifyRestoreOutcome``): no condition yet is Pending; True is Succeeded; False
is Failed, PartiallySucceeded or Pending by its reason; anything else (an unknown status or reason: a
newer agent's) is Unknown, for the reader's own version-skew policy. And whether a pod asks for its
restore without the compatibility checks (``nvidia.com/snapshot-skip-compat-check``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from dynamo_snapshot.api import protocol

__all__ = [
    "REOPENED_MESSAGE",
    "REPLENISHMENT_INCOMPATIBLE",
    "RestoreOutcome",
    "classify_restore_outcome",
    "skip_compat_check",
]

Reason = protocol.RestoredReason
# The contract's reason of another agent (NVIDIA's): the restore of a replaced container refused as
# incompatible. This project's agent says RestoreFailed (naming the container) instead.
REPLENISHMENT_INCOMPATIBLE = "RestoreReplenishmentIncompatible"

# The Event on a pod whose refused restore its skip-compat-check annotation reopens.
REOPENED_MESSAGE = (
    f"{protocol.ANNOTATION_SKIP_COMPAT_CHECK} is set: the restore refused as incompatible is attempted anyway"
)
# Go's strconv.ParseBool, the upstream reader of the annotation: these and nothing else.
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


class RestoreOutcome(StrEnum):
    PENDING = "Pending"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    PARTIALLY_SUCCEEDED = "PartiallySucceeded"
    UNKNOWN = "Unknown"

    @property
    def terminal(self) -> bool:
        return self in (RestoreOutcome.SUCCEEDED, RestoreOutcome.FAILED, RestoreOutcome.PARTIALLY_SUCCEEDED)


_BY_FALSE_REASON: dict[str, RestoreOutcome] = {
    Reason.FAILED: RestoreOutcome.FAILED,
    Reason.INCOMPATIBLE: RestoreOutcome.FAILED,
    REPLENISHMENT_INCOMPATIBLE: RestoreOutcome.FAILED,
    Reason.PARTIALLY_SUCCEEDED: RestoreOutcome.PARTIALLY_SUCCEEDED,
    Reason.IN_PROGRESS: RestoreOutcome.PENDING,
    Reason.REPLENISHING: RestoreOutcome.PENDING,
}


def classify_restore_outcome(conditions: Iterable[Mapping[str, Any]] | None) -> RestoreOutcome:
    """The outcome the first ``nvidia.com/Restored`` condition of ``conditions`` (a pod's
    status.conditions) states."""
    for c in conditions or ():
        if c.get("type") != protocol.POD_CONDITION_RESTORED:
            continue
        if c.get("status") == "True":
            return RestoreOutcome.SUCCEEDED
        if c.get("status") != "False":
            return RestoreOutcome.UNKNOWN
        return _BY_FALSE_REASON.get(str(c.get("reason") or ""), RestoreOutcome.UNKNOWN)
    return RestoreOutcome.PENDING


def skip_compat_check(annotations: Mapping[str, object] | None) -> bool:
    """Whether ``nvidia.com/snapshot-skip-compat-check`` asks for the restore without the compatibility
    checks: only a value Go's ParseBool reads as true does ("yes", say, leaves the checks in place)."""
    value = (annotations or {}).get(protocol.ANNOTATION_SKIP_COMPAT_CHECK)
    return isinstance(value, str) and value.strip() in _TRUE
