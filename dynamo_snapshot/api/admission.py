"""admission.k8s.io/v1 AdmissionReview, as a mutating webhook reads and answers it: only the fields the
restore webhook uses are declared; every other field the apiserver sends is carried through unread.

The apiserver sends a review with ``request`` and expects the same review back with ``response``, whose
``uid`` echoes the request's. A patch is a base64-encoded JSON Patch (RFC 6902).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Final, Literal

from pydantic import Field

from dynamo_snapshot.api.kube import KubeModel

__all__ = [
    "ADMISSION_API_VERSION",
    "AdmissionRequest",
    "AdmissionResponse",
    "AdmissionReview",
    "AdmissionStatus",
    "GroupVersionKind",
    "Operation",
    "allow",
    "deny",
]

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class GroupVersionKind(KubeModel):
    group: str = ""
    version: str
    kind: str


class AdmissionRequest(KubeModel):
    uid: str = Field(min_length=1, description="Echoed in the response; the apiserver matches on it.")
    kind: GroupVersionKind
    operation: Operation
    namespace: str | None = None
    name: str | None = None
    object: dict[str, Any] | None = None
    dry_run: bool | None = None


class AdmissionStatus(KubeModel):
    """The metav1.Status of a refusal: its message is what kubectl prints."""

    code: int | None = None
    message: str | None = None
    reason: str | None = None


class AdmissionResponse(KubeModel):
    uid: str
    allowed: bool
    status: AdmissionStatus | None = None
    patch: str | None = Field(default=None, description="base64 of a JSON Patch")
    patch_type: Literal["JSONPatch"] | None = None
    warnings: list[str] | None = None


class AdmissionReview(KubeModel):
    api_version: Literal["admission.k8s.io/v1"] = "admission.k8s.io/v1"
    kind: Literal["AdmissionReview"] = "AdmissionReview"
    request: AdmissionRequest | None = None
    response: AdmissionResponse | None = None

    def answer(self, response: AdmissionResponse) -> dict[str, Any]:
        """The review to send back: apiVersion and kind as received, the response, no request."""
        reply = AdmissionReview(response=response)
        return reply.model_dump(mode="json", by_alias=True, exclude_none=True)


def allow(
    uid: str, patch: list[dict[str, Any]] | None = None, warnings: list[str] | None = None
) -> AdmissionResponse:
    """Admit, with ``patch`` (JSON Patch operations; none or empty: unchanged) and ``warnings``."""
    response = AdmissionResponse(uid=uid, allowed=True, warnings=warnings or None)
    if patch:
        response.patch = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
        response.patch_type = "JSONPatch"
    return response


def deny(uid: str, message: str, *, code: int = 403, reason: str = "Forbidden") -> AdmissionResponse:
    """Refuse with ``message``, which the creator (kubectl, a controller's event) shows as it is."""
    return AdmissionResponse(
        uid=uid, allowed=False, status=AdmissionStatus(code=code, message=message, reason=reason)
    )
