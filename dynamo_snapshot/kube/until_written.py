"""Reads that may find nothing, and writes that must land: an agent's outcome of a capture or a restore is
in hand once, so it is written until the apiserver takes it, or gives an answer no retry changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from dynamo_snapshot.kube.kube import ApiError, Kube, Obj, ResourceKind, is_not_found

__all__ = ["get_or_none", "permanent", "write_until_done"]

log = logging.getLogger(__name__)

# Answers in 4xx that a retry can change: credentials since refreshed (401), a timeout (408), a
# conflict (409), throttling (429).
_RETRYABLE_4XX = frozenset({401, 408, 409, 429})


def permanent(http_status: int) -> bool:
    """Whether no retry can change the apiserver's answer of this HTTP status: the writer may not write the
    object (403), it is gone (404), the patch is invalid (422), say. 5xx and throttling pass."""
    return 400 <= http_status < 500 and http_status not in _RETRYABLE_4XX


async def get_or_none(kube: Kube, kind: ResourceKind, name: str, namespace: str | None) -> Obj | None:
    """The object, or None where there is none; any other error is raised."""
    try:
        return await kube.get(kind, name, namespace)
    except ApiError as e:
        if is_not_found(e):
            return None
        raise


async def write_until_done(
    write: Callable[[], Awaitable[Any]],
    *,
    what: str,
    extra: Mapping[str, object],
    backoff: Callable[[int], float],
) -> bool:
    """Run ``write`` until it succeeds (True), retrying with ``backoff(attempt)`` seconds between tries.
    An answer no retry changes (``permanent``) is logged and given up: False; an object gone meanwhile (404)
    is a warning, as it has nobody left to tell, any other such answer an error. ``what`` names the write in
    the logs ("the pod's annotations"), ``extra`` says of what."""
    attempt = 0
    while True:
        try:
            await write()
            return True
        except Exception as e:
            if isinstance(e, ApiError) and permanent(e.status):
                log.log(
                    logging.WARNING if is_not_found(e) else logging.ERROR,
                    f"giving up on {what}: the apiserver refused it for good",
                    extra={
                        **extra,
                        "attempt": attempt + 1,
                        "http_status": e.status,
                        "reason": e.reason,
                        "detail": e.message,
                    },
                )
                return False
            attempt += 1
            delay = backoff(attempt)
            log.exception(
                f"writing {what} failed; retrying", extra={**extra, "attempt": attempt, "retry_in_s": delay}
            )
            await asyncio.sleep(delay)
