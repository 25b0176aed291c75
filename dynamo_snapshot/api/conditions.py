"""metav1.Condition bookkeeping, as the controller's and the autoscaler's statuses write it: a condition's
lastTransitionTime moves only when its status changes; a bad spec is said in one line."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api.views import ObjectView

READY = "Ready"
CHECKPOINT_READY = "CheckpointReady"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
# Terminal failure beside Ready, as NVIDIA Snapshot's PodSnapshot and PodSnapshotContent say it.
FAILED = "Failed"

# Reasons of the Ready and Degraded conditions (and of the Warning Events that go with them) that name a
# cause a reader can act on; anything else is reported under the generic ones.
POD_CREATE_REJECTED = "PodCreateRejected"  # the apiserver refused a worker pod (admission, quota, schema)
REQUEST_REJECTED = "RequestRejected"  # the apiserver refused another write made for a service
SERVICE_NOT_HANDLED = "ServiceNotHandled"  # a service the controller does not run, and why


_RFC3339 = "%Y-%m-%dT%H:%M:%SZ"  # metav1.Time on the wire: seconds, UTC


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime(_RFC3339)


def parse_rfc3339(stamp: str) -> datetime:
    """A metav1.Time as an aware UTC datetime; ValueError when it is not one."""
    return datetime.strptime(stamp, _RFC3339).replace(tzinfo=UTC)


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """Return `conditions` with `type_` set; other types are kept as they are."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    transition = old["lastTransitionTime"] if old and old.get("status") == value else now_rfc3339()
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": transition,
    }
    if generation is not None:
        new["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != type_] + [new]


def find_condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The object's condition of ``type_`` (from ``status.conditions``), or None."""
    return ObjectView(obj).condition(type_) or None


def is_true(obj: dict[str, Any], type_: str) -> bool:
    return ObjectView(obj).condition_true(type_)


def set_outcome(
    conditions: list[dict[str, Any]], ready: bool, reason: str, message: str, generation: int | None
) -> list[dict[str, Any]]:
    """Ready and Failed set together, as opposites, with one reason and message: a capture's outcome."""
    conditions = set_condition(conditions, READY, ready, reason, message, generation)
    return set_condition(conditions, FAILED, not ready, reason, message, generation)


def validation_message(err: ValidationError) -> str:
    """One line naming the first bad field, for Events and Conditions."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {first['msg']}{more}"
