"""Record core/v1 Events about objects, folding repeats into one Event with a count.

Recording is fire-and-forget: ``record()`` never blocks and never raises, because an Event is a
courtesy to the human running ``kubectl describe``, never a reason for a reconcile to fail.  One
background task writes them in order, which also keeps two repeats of an Event from racing to create it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from cachetools import LRUCache
from prometheus_client import Counter

from dynamo_snapshot.kube.kube import EVENT, ApiError, Kube, Obj, is_not_found

log = logging.getLogger(__name__)

NORMAL: Final = "Normal"
WARNING: Final = "Warning"
_MAX_MESSAGE: Final = 1024

EVENTS_WRITTEN = Counter(
    "dynsnap_events_total", "Kubernetes Events recorded, by type and outcome", ["type", "outcome"]
)


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = ""

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectRef:
        meta = obj.get("metadata") or {}
        return cls(
            kind=str(obj.get("kind", "")),
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace") or ""),
            uid=str(meta.get("uid") or ""),
            api_version=str(obj.get("apiVersion", "")),
        )

    def describe(self) -> str:
        return "/".join(part for part in (self.kind, self.namespace, self.name) if part)

    def as_involved_object(self) -> Obj:
        ref = {
            "kind": self.kind,
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "apiVersion": self.api_version,
        }
        return {k: v for k, v in ref.items() if v}


@dataclass(slots=True)
class _Seen:
    name: str
    namespace: str
    count: int


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Writes Events as ``component`` (shown as the Event's source) from ``instance`` (e.g. the pod)."""

    def __init__(
        self,
        kube: Kube,
        component: str,
        *,
        instance: str = "",
        cache_size: int = 4096,
        max_pending: int = 1000,
    ) -> None:
        self.kube = kube
        self.component = component
        self.instance = instance
        # (ref, type, reason, message) -> the Event that already says it
        self._seen: LRUCache[tuple[ObjectRef, str, str, str], _Seen] = LRUCache(maxsize=cache_size)
        self._pending: asyncio.Queue[tuple[ObjectRef, str, str, str]] = asyncio.Queue(maxsize=max_pending)
        self._writer: asyncio.Task[None] | None = None

    def record(self, obj: Mapping[str, Any] | ObjectRef, type_: str, reason: str, message: str) -> None:
        """Queue an Event about ``obj`` (an API object dict or an ObjectRef); never blocks or raises."""
        try:
            ref = obj if isinstance(obj, ObjectRef) else ObjectRef.of(obj)
            if not (ref.kind and ref.name):
                EVENTS_WRITTEN.labels(type_, "dropped").inc()
                log.warning("event about an object without kind or name dropped", extra={"reason": reason})
                return
            if len(message) > _MAX_MESSAGE:
                message = message[: _MAX_MESSAGE - 3] + "..."
            self._pending.put_nowait((ref, type_, reason, message))
            # The log carries every Event too (they outlive the apiserver's event TTL there); one said again
            # (a count on the same Event) only at debug, so a reconcile that repeats it does not flood it.
            repeated = (ref, type_, reason, message) in self._seen
            log.log(
                logging.DEBUG if repeated else logging.WARNING if type_ == WARNING else logging.INFO,
                "event",
                extra={"object": ref.describe(), "reason": reason, "event_message": message},
            )
            if self._writer is None or self._writer.done():
                self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="event-writer")
        except asyncio.QueueFull:
            EVENTS_WRITTEN.labels(type_, "dropped").inc()
            log.warning(
                "event queue full, dropping event", extra={"reason": reason, "event_message": message}
            )
        except Exception:
            log.exception("could not queue event", extra={"reason": reason})

    async def flush(self) -> None:
        """Wait until every queued Event has been written (or has failed)."""
        await self._pending.join()

    async def close(self, flush_timeout: float = 5.0) -> None:
        """Flush for up to ``flush_timeout`` seconds, then stop the writer."""
        try:
            await asyncio.wait_for(self.flush(), flush_timeout)
        except TimeoutError:
            log.warning("events still unwritten at shutdown", extra={"pending": self._pending.qsize()})
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None

    async def _write_loop(self) -> None:
        while True:
            ref, type_, reason, message = await self._pending.get()
            try:
                await self._write(ref, type_, reason, message)
                EVENTS_WRITTEN.labels(type_, "written").inc()
            except Exception as e:
                EVENTS_WRITTEN.labels(type_, "failed").inc()
                log.warning(
                    "event write failed",
                    extra={
                        "object": ref.describe(),
                        "reason": reason,
                        "error": repr(e),
                    },
                )
            finally:
                self._pending.task_done()

    async def _write(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        key = (ref, type_, reason, message)
        now = _now()
        seen = self._seen.get(key)
        if seen is not None:
            try:
                await self.kube.merge_patch(
                    EVENT, seen.name, {"count": seen.count + 1, "lastTimestamp": now}, seen.namespace
                )
                seen.count += 1
                return
            except ApiError as e:
                if not is_not_found(e):
                    raise
                # The apiserver's event TTL removed it; start a new one.
        # Events about cluster-scoped objects (Nodes) live in "default", as kubelet's do.
        namespace = ref.namespace or "default"
        # client-go's naming; the suffix keeps repeats created after a TTL expiry distinct.
        name = f"{ref.name[:236]}.{time.time_ns():x}"
        event: Obj = {
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref.as_involved_object(),
            "type": type_,
            "reason": reason,
            "message": message,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": self.component},
            "reportingComponent": self.component,
        }
        if self.instance:
            event["reportingInstance"] = self.instance
        await self.kube.create(EVENT, event, namespace)
        self._seen[key] = _Seen(name, namespace, 1)
