"""List+watch one kind into a local cache and tell handlers what changed (client-go's shared informer).

The cache is the controller's view of the cluster: reconcilers read it instead of the apiserver, and it
is kept consistent across watch restarts, expired resourceVersions (re-list and diff) and apiserver
outages (capped exponential backoff).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import random
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from contextlib import aclosing, suppress
from typing import Any, Final

from prometheus_client import Counter, Gauge

from dynamo_snapshot.kube.kube import (
    ApiError,
    Kube,
    Obj,
    ResourceKind,
    is_gone,
    object_key,
)

log = logging.getLogger(__name__)

ADDED: Final = "ADDED"
MODIFIED: Final = "MODIFIED"
DELETED: Final = "DELETED"

# handler(event_type, obj, old_obj): old_obj is None for ADDED, the previous cached state otherwise.
EventHandler = Callable[[str, Obj, Obj | None], Awaitable[None]]
Transform = Callable[[Obj], Obj]

WATCH_RESTARTS = Counter(
    "dynsnap_informer_watch_restarts_total", "Watch streams restarted, by reason", ["kind", "reason"]
)
EVENTS = Counter("dynsnap_informer_events_total", "Events delivered to handlers", ["kind", "type"])
CACHE_SIZE = Gauge("dynsnap_informer_cache_objects", "Objects held in informer caches", ["kind"])

# Long strings are mostly unique (messages, certificates); interning them would only cost lookups.
_INTERN_MAX_LEN: Final = 64
# Handlers usually don't suspend, so a relist of thousands of objects would otherwise hold the loop.
_YIELD_EVERY: Final = 256


def compact(obj: Obj) -> Obj:
    """Default transform: drop managedFields and share repeated strings between cached objects.

    managedFields are often half of an object and no reconciler reads them.  Every watch event is parsed
    on its own, so without interning each cached pod would hold private copies of the same keys and
    common values ("metadata", "Running", the image name...); interning cuts a cached pod by about a
    third, which is what keeps 10,000 pods well under the controller's memory budget.
    """
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    out: Obj = _interned(obj)
    return out


def _interned(value: Any, _intern: Callable[[str], str] = sys.intern) -> Any:
    # Rebuilding (rather than editing in place) also lets the parser's short-lived memory be reused.
    kind = type(value)
    if kind is dict:
        return {_intern(k): _interned(v) for k, v in value.items()}
    if kind is list:
        return [_interned(v) for v in value]
    if kind is str and len(value) <= _INTERN_MAX_LEN:
        return _intern(value)
    return value


def _rv(obj: Obj) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv is not None else None


def _labels(obj: Obj) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


class Informer:
    """Watch ``kind`` (in ``namespace``, or all namespaces when None) and cache it by "namespace/name".

    Handlers run in event order on the informer's task; keep them short (enqueue work, don't do it).
    Cached objects are shared with handlers and callers: treat them as read-only.
    """

    def __init__(
        self,
        kube: Kube,
        kind: ResourceKind,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
        watch_timeout: int = 300,
        read_timeout: float | None = None,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        transform: Transform | None = compact,
        indexed_labels: Iterable[str] = (),
    ) -> None:
        self.kube = kube
        self.kind = kind
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.read_timeout = read_timeout
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.transform = transform
        self.has_synced = asyncio.Event()
        self._handlers: list[EventHandler] = []
        self._store: dict[str, Obj] = {}
        # label key -> label value -> cache keys
        self._label_index: dict[str, defaultdict[str, set[str]]] = {
            k: defaultdict(set) for k in indexed_labels
        }
        self._resource_version: str | None = None
        # Per cache key: set (and dropped) at the next event of that object (``next_change``).
        self._changes: dict[str, asyncio.Event] = {}
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self._log_extra = {"kind": kind.kind, "namespace": namespace or "*"}

    # ------------------------------------------------------------------ reading the cache
    def add_handler(self, handler: EventHandler) -> None:
        """Register ``handler``; added before start, it also sees every object of the initial list."""
        self._handlers.append(handler)

    async def next_change(self, key: str, within: float) -> None:
        """Until the next event of the object under ``key`` is in the cache, or ``within`` seconds: a
        caller that read the cache and found it not yet as it needs waits here, not in a polling sleep."""
        changed = self._changes.setdefault(key, asyncio.Event())
        with suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), within)

    def get(self, key: str) -> Obj | None:
        return self._store.get(key)

    def list(self) -> builtins.list[Obj]:
        return list(self._store.values())

    def keys(self) -> builtins.list[str]:
        return list(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def by_label(self, label_key: str, value: str) -> builtins.list[Obj]:
        """Cached objects labelled ``label_key=value``; the first call for a key builds its index."""
        index = self._label_index.get(label_key)
        if index is None:
            index = self._label_index[label_key] = defaultdict(set)
            for key, obj in self._store.items():
                if (v := _labels(obj).get(label_key)) is not None:
                    index[v].add(key)
        return [self._store[k] for k in index.get(value, ())]

    @property
    def resource_version(self) -> str | None:
        return self._resource_version

    async def wait_synced(self) -> None:
        await self.has_synced.wait()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"informer-{self.kind.kind}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """List then watch until cancelled; resumes from the last resourceVersion if run again."""
        try:
            while True:
                reason = await self._cycle()
                WATCH_RESTARTS.labels(self.kind.kind, reason).inc()
                if reason in ("api_error", "connection", "closed_early"):
                    await asyncio.sleep(self._next_backoff())
        finally:
            log.debug("informer stopped", extra=self._log_extra)

    def _next_backoff(self) -> float:
        self._failures += 1
        delay = min(self.backoff_cap, self.backoff_base * 2.0 ** (self._failures - 1))
        return delay * random.uniform(0.5, 1.0)

    async def _cycle(self) -> str:
        """One list-if-needed + watch; returns why the watch ended (the restart reason)."""
        try:
            if self._resource_version is None:
                await self._relist()
            started = asyncio.get_running_loop().time()
            await self._watch()
            # A server that keeps closing watches at once must not turn this loop into a hot spin.
            return "timeout" if asyncio.get_running_loop().time() - started > 1.0 else "closed_early"
        except ApiError as e:
            if is_gone(e):
                log.info("resourceVersion expired, re-listing", extra={**self._log_extra, "error": str(e)})
                self._resource_version = None
                return "gone"
            log.warning("watch failed", extra={**self._log_extra, "status": e.status, "error": str(e)})
            return "api_error"
        except TimeoutError:
            log.info("watch went silent past the read timeout, reconnecting", extra=self._log_extra)
            return "read_timeout"
        except Exception as e:
            # Connection resets, TLS errors, truncated bodies: anything but cancellation retries.
            log.warning("watch connection failed", extra={**self._log_extra, "error": repr(e)})
            return "connection"

    async def _relist(self) -> None:
        items, rv = await self.kube.list_all(
            self.kind,
            self.namespace,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            page_size=self.page_size,
            transform=self._prepare_listed,
        )
        fresh = {object_key(obj): obj for obj in items}
        del items
        for key in [k for k in self._store if k not in fresh]:
            await self._apply(DELETED, key, self._store[key])
        for n, (key, obj) in enumerate(fresh.items()):
            old = self._store.get(key)
            if old is None:
                await self._apply(ADDED, key, obj)
            elif _rv(old) != _rv(obj):
                await self._apply(MODIFIED, key, obj)
            if n % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        self._resource_version = rv
        self._failures = 0
        if not self.has_synced.is_set():
            log.info("informer synced", extra={**self._log_extra, "objects": len(self._store)})
            self.has_synced.set()

    def _prepare_listed(self, item: Obj) -> Obj:
        # List items carry no apiVersion/kind; handlers that build ownerRefs or events need them.
        item.setdefault("apiVersion", self.kind.api_version)
        item.setdefault("kind", self.kind.kind)
        return self.transform(item) if self.transform else item

    async def _watch(self) -> None:
        # Jitter spreads the reconnects of many informers started together.
        server_timeout = max(1, int(self.watch_timeout * random.uniform(0.9, 1.1)))
        stream = self.kube.watch(
            self.kind,
            self.namespace,
            resource_version=self._resource_version,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            timeout_seconds=server_timeout,
            read_timeout=self.read_timeout,
        )
        async with aclosing(stream) as events:
            async for etype, obj in events:
                self._failures = 0
                rv = _rv(obj)
                if etype == "BOOKMARK":
                    self._resource_version = rv or self._resource_version
                    continue
                if etype not in (ADDED, MODIFIED, DELETED):
                    log.warning("unknown watch event", extra={**self._log_extra, "type": etype})
                    continue
                if self.transform:
                    obj = self.transform(obj)
                key = object_key(obj)
                if etype == ADDED and key in self._store:
                    etype = MODIFIED
                elif etype == MODIFIED and key not in self._store:
                    etype = ADDED
                await self._apply(etype, key, obj)
                self._resource_version = rv or self._resource_version

    # ------------------------------------------------------------------ store + dispatch
    async def _apply(self, etype: str, key: str, obj: Obj) -> None:
        old = self._store.get(key)
        if old is not None:
            self._unindex(key, old)
        if etype == DELETED:
            if old is not None:
                del self._store[key]
                CACHE_SIZE.labels(self.kind.kind).dec()
        else:
            self._store[key] = obj
            self._index(key, obj)
            if old is None:
                CACHE_SIZE.labels(self.kind.kind).inc()
        EVENTS.labels(self.kind.kind, etype).inc()
        changed = self._changes.pop(key, None)
        if changed is not None:
            changed.set()
        for handler in self._handlers:
            try:
                await handler(etype, obj, old)
            except Exception:
                log.exception("informer handler failed", extra={**self._log_extra, "key": key, "type": etype})

    def _index(self, key: str, obj: Obj) -> None:
        labels = _labels(obj)
        for label_key, index in self._label_index.items():
            if (v := labels.get(label_key)) is not None:
                index[v].add(key)

    def _unindex(self, key: str, obj: Obj) -> None:
        labels = _labels(obj)
        for label_key, index in self._label_index.items():
            if (v := labels.get(label_key)) is not None and (keys := index.get(v)) is not None:
                keys.discard(key)
                if not keys:
                    del index[v]
