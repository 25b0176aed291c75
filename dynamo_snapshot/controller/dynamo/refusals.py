"""What the apiserver refuses for a DGD's service (admission, a quota, a field the CRD schema cannot check):
remembered per service with a backoff, and said once as a Warning Event rather than once per retry."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TypeGuard

from dynamo_snapshot.api.views import Meta, ObjectView
from dynamo_snapshot.kube import WARNING, ApiError, EventRecorder, Obj

log = logging.getLogger(__name__)
# A service whose writes the apiserver refuses is tried again after this long, doubling per refusal up to
# the cap (or at once when the DGD's spec changes): a quota lifted or a webhook fixed is noticed within a
# minute, and a refusal costs one request per retry, not one per informer event.
REFUSAL_BACKOFF_BASE = 1.0
REFUSAL_BACKOFF_CAP = 60.0
# 4xx answers a retry can change with nobody fixing anything: credentials since refreshed (401), a timeout
# (408), a conflict (409), throttling (429).
_TRANSIENT_4XX = frozenset({401, 408, 409, 429})

# (DGD key, service name)
Owner = tuple[str, str]


def refused(err: BaseException) -> TypeGuard[ApiError]:
    """Whether the apiserver refused a request for what it asked (admission, quota, validation, RBAC):
    sent again unchanged, it gets the same answer."""
    return isinstance(err, ApiError) and 400 <= err.status < 500 and err.status not in _TRANSIENT_4XX


def refusal_text(err: ApiError) -> str:
    return f"{err.status} {err.reason or 'refused'}: {err.message or 'no message'}"


def owner_of(obj: Obj, svc_name: str) -> Owner:
    meta = Meta(obj)
    return (f"{meta.namespace}/{meta.name}", svc_name)


@dataclass
class Refusal:
    """The apiserver's last refusal of a write for one service, and when to try again."""

    reason: str  # cond.POD_CREATE_REJECTED or cond.REQUEST_REJECTED
    message: str
    generation: int | None  # the DGD generation it was refused at: a new spec is tried at once
    attempts: int
    retry_at: float  # time.monotonic()
    # A refusal outside pod creation holds back the service's whole reconcile until retry_at; a refused
    # pod holds back only pod creation, so scale-down and failover bookkeeping go on.
    whole_service: bool = False


class CreateHeldBack(Exception):
    """A replacement pod not created: the apiserver refused it, or an earlier refusal's backoff runs."""


class Refusals:
    """Each service's standing refusal, and the Warning Event last recorded for each service.

    In memory only: after a restart a refused write is tried again at once, and the DGD's conditions keep
    its Warning Event from being repeated (see `announce`).
    """

    def __init__(self, recorder: EventRecorder) -> None:
        self.recorder = recorder
        self.current: dict[Owner, Refusal] = {}
        self._announced: dict[Owner, tuple[str, str]] = {}

    def held_back(self, owner: Owner) -> Refusal | None:
        """The refusal whose backoff still holds back creating pods for the service, if any."""
        refusal = self.current.get(owner)
        return refusal if refusal is not None and refusal.retry_at > time.monotonic() else None

    def refuse(
        self, obj: Obj, svc_name: str, reason: str, message: str, *, whole_service: bool = False
    ) -> Refusal:
        """Remember a refusal and when to try again; say it once (Event, log line without a traceback)."""
        owner = owner_of(obj, svc_name)
        previous = self.current.get(owner)
        attempts = previous.attempts + 1 if previous is not None else 1
        delay = min(REFUSAL_BACKOFF_CAP, REFUSAL_BACKOFF_BASE * 2.0 ** min(attempts - 1, 32))
        message = f"{message}; retried with backoff"
        refusal = Refusal(
            reason,
            message,
            Meta(obj).generation,
            attempts,
            time.monotonic() + delay,
            whole_service,
        )
        self.current[owner] = refusal
        if self.announce(obj, svc_name, reason, message):
            log.warning(
                "the apiserver refused a write; retrying with backoff",
                extra={"dgd": owner[0], "service": svc_name, "reason": reason, "detail": message},
            )
        return refusal

    def announce(self, obj: Obj, svc_name: str, reason: str, message: str) -> bool:
        """One Warning Event per state of a service: none while it stays in the state this one says, nor
        after a controller restart when the DGD's conditions say it already. Whether it was recorded."""
        owner = owner_of(obj, svc_name)
        if self._announced.get(owner) == (reason, message):
            return False
        self._announced[owner] = (reason, message)
        if any(message in (c.get("message") or "") for c in ObjectView(obj).conditions):
            return False
        self.recorder.record(obj, WARNING, reason, message)
        return True

    def settled(self, owner: Owner) -> None:
        """The service is in no refused state any more: its next refusal is announced again."""
        self._announced.pop(owner, None)

    def retry_changed_spec(self, key: str, generation: int | None) -> None:
        """A DGD whose spec changed since a refusal is tried again at once: the change may be the fix."""
        for owner in [o for o, r in self.current.items() if o[0] == key and r.generation != generation]:
            del self.current[owner]

    def forget(self, key: str) -> None:
        """Drop what is remembered about DGD `key`, which is gone."""
        for owner in [o for o in self.current if o[0] == key]:
            del self.current[owner]
        for owner in [o for o in self._announced if o[0] == key]:
            del self._announced[owner]
