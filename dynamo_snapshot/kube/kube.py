"""A thin async Kubernetes REST client that speaks plain JSON dicts.

Generated models cost several times the memory of the dicts they are built from and a deep copy on every
read; a controller that caches 10,000 pods cannot afford that.  So this client goes through
``ApiClient.call_api`` only for what it does well (TLS, client certificates, bearer-token refresh, the
connection pool) and reads and parses every response itself.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
import random
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from dynamo_snapshot.api.views import Meta

log = logging.getLogger(__name__)

Obj = dict[str, Any]
T = TypeVar("T")

_JSON: Final = "application/json"
_MERGE_PATCH: Final = "application/merge-patch+json"
_JSON_PATCH: Final = "application/json-patch+json"
_APPLY_PATCH: Final = "application/apply-patch+yaml"
# Parsing a list of thousands of objects takes long enough to stall every other coroutine.
_PARSE_OFF_LOOP_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class ResourceKind:
    """Where a kind lives in the REST API; ``group`` is "" for the core group."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @classmethod
    def custom(
        cls, group: str, version: str, kind: str, plural: str | None = None, *, namespaced: bool = True
    ) -> ResourceKind:
        """Declare a CRD kind; ``plural`` defaults to the lower-cased kind plus "s", as kubebuilder does."""
        return cls(group, version, plural or f"{kind.lower()}s", kind, namespaced)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        elif self.namespaced and name is not None:
            raise ValueError(f"{self.kind} {name!r} is namespaced: a namespace is required")
        base += f"/{self.plural}"
        if name is not None:
            if not name:
                raise ValueError(f"empty {self.kind} name")
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


POD: Final = ResourceKind("", "v1", "pods", "Pod")
NODE: Final = ResourceKind("", "v1", "nodes", "Node", namespaced=False)
NAMESPACE: Final = ResourceKind("", "v1", "namespaces", "Namespace", namespaced=False)
CONFIG_MAP: Final = ResourceKind("", "v1", "configmaps", "ConfigMap")
EVENT: Final = ResourceKind("", "v1", "events", "Event")
LEASE: Final = ResourceKind("coordination.k8s.io", "v1", "leases", "Lease")
# The body of every kind's scale subresource.
SCALE_API_VERSION: Final = "autoscaling/v1"


class ApiError(Exception):
    """A non-2xx answer from the apiserver, with the fields of its ``Status`` body."""

    def __init__(self, status: int, reason: str = "", message: str = "", body: Obj | None = None) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")

    @classmethod
    def from_status(cls, status_obj: Mapping[str, Any], http_status: int = 0) -> ApiError:
        return cls(
            int(status_obj.get("code") or http_status),
            str(status_obj.get("reason") or ""),
            str(status_obj.get("message") or ""),
            dict(status_obj),
        )

    @classmethod
    def from_body(cls, http_status: int, raw: bytes) -> ApiError:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("kind") == "Status":
            return cls.from_status(parsed, http_status)
        return cls(http_status, "", raw[:512].decode("utf-8", "replace"))


def _has_status(err: BaseException, status: int, reason: str | None = None) -> bool:
    if not isinstance(err, ApiError):
        return False
    return err.status == status and (reason is None or err.reason == reason)


def is_not_found(err: BaseException) -> bool:
    return _has_status(err, 404)


def is_conflict(err: BaseException) -> bool:
    """A stale resourceVersion or a failed precondition (409 Conflict), not "already exists"."""
    return _has_status(err, 409) and not is_already_exists(err)


def is_already_exists(err: BaseException) -> bool:
    return _has_status(err, 409, "AlreadyExists")


def is_gone(err: BaseException) -> bool:
    """410: the requested resourceVersion (or a list's continue token) is older than the server keeps."""
    return _has_status(err, 410)


async def conflict_retry(fn: Callable[[], Awaitable[T]], attempts: int = 5, base_delay: float = 0.01) -> T:
    """Run a read-modify-write ``fn`` again while it loses optimistic-concurrency races (client-go's
    RetryOnConflict).  ``fn`` must re-read the object each time, or it will conflict forever."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except ApiError as e:
            if not is_conflict(e) or attempt == attempts:
                raise
            log.debug("conflict, retrying", extra={"attempt": attempt, "error": str(e)})
            await asyncio.sleep(base_delay * attempt * (1 + random.random()))
    raise AssertionError("unreachable")


async def load_client(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """An ApiClient for ``kubeconfig``, else the in-cluster service account, else ~/.kube/config."""
    cfg = k8s_client.Configuration()
    if kubeconfig:
        await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        # Reads two small files from the pod's service-account mount; off the loop all the same.
        await asyncio.to_thread(k8s_config.load_incluster_config, client_configuration=cfg)
    else:
        await k8s_config.load_kube_config(client_configuration=cfg)
    if not cfg.proxy:
        cfg.proxy = _env_proxy(cfg.host)
    api_client = k8s_client.ApiClient(cfg)
    _stop_per_request_env_lookups(api_client)
    return api_client


def _env_proxy(url: str | None) -> str | None:
    """The proxy HTTPS_PROXY/HTTP_PROXY/NO_PROXY name for ``url``, looked up once (client-go honours them)."""
    parts = urllib.parse.urlsplit(url or "")
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def _stop_per_request_env_lookups(api_client: k8s_client.ApiClient) -> None:
    """Performance (benchmarks/controller_scale.py): kubernetes_asyncio opens its aiohttp session with
    ``trust_env=True``, so *every* request reads ~/.netrc and the proxy environment in the default thread
    pool.  Those two thread hops cost about 0.5 ms of CPU per request (measured against the local
    apiserver: 0.95 -> 0.42 ms of client CPU per create) and, worse, GIL hand-offs that stall the event
    loop.  Kubernetes credentials never come from .netrc, and the environment's proxy is resolved once by
    load_client (``Configuration.proxy``), so the session is told to stop looking.
    """
    session = getattr(getattr(api_client, "rest_client", None), "pool_manager", None)
    if session is not None and hasattr(session, "_trust_env"):  # aiohttp 3.x keeps the flag here
        session._trust_env = False


def _query(**params: str | int | bool | None) -> dict[str, str]:
    out = {}
    for k, v in params.items():
        if v is None:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return out


async def _parse(raw: bytes) -> Any:
    if len(raw) >= _PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(json.loads, raw)
    return json.loads(raw)


class Kube:
    """Async CRUD, patch, apply and watch over plain dicts.

    ``request_timeout`` bounds every call except watches, whose liveness is a per-read timeout instead.
    """

    def __init__(
        self, api_client: k8s_client.ApiClient, *, request_timeout: float = 30.0, field_manager: str = ""
    ) -> None:
        self.api_client = api_client
        self.request_timeout = request_timeout
        self.field_manager = field_manager

    # ------------------------------------------------------------------ transport
    async def _open(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = _JSON,
        # float: total; (connect, read): aiohttp's per-read timeout (the library's stub misspells it)
        request_timeout: Any = None,
    ) -> Any:
        """Send a request and return the open aiohttp response, raising ApiError for a non-2xx one."""
        resp = await self.api_client.call_api(
            path,
            method,
            query_params=dict(query or {}),
            header_params={"Accept": _JSON, "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=request_timeout if request_timeout is not None else self.request_timeout,
        )
        if resp.status >= 300:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise ApiError.from_body(resp.status, raw)
        return resp

    async def _call(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = _JSON,
    ) -> Obj:
        resp = await self._open(method, path, query, body, content_type)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        result = await _parse(raw) if raw else {}
        if not isinstance(result, dict):
            raise ApiError(resp.status, "BadResponse", f"expected a JSON object from {method} {path}")
        return result

    def _field_manager(self, field_manager: str | None) -> str | None:
        return field_manager or self.field_manager or None

    # ------------------------------------------------------------------ reads
    async def get(self, kind: ResourceKind, name: str, namespace: str | None = None) -> Obj:
        return await self._call("GET", kind.path(namespace, name))

    async def get_scale(self, kind: ResourceKind, name: str, namespace: str | None = None) -> Obj:
        """The autoscaling/v1 Scale of an object whose kind has a scale subresource."""
        return await self._call("GET", kind.path(namespace, name, "scale"))

    async def list(
        self,
        kind: ResourceKind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        resource_version: str | None = None,
    ) -> Obj:
        """One page: the List object, whose ``metadata.continue`` is set when more pages remain."""
        query = _query(
            labelSelector=label_selector,
            fieldSelector=field_selector,
            limit=limit,
            resourceVersion=resource_version,
        )
        if continue_token:
            query["continue"] = continue_token
        return await self._call("GET", kind.path(namespace), query)

    async def list_all(
        self,
        kind: ResourceKind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
        transform: Callable[[Obj], Obj] | None = None,
    ) -> tuple[builtins.list[Obj], str]:
        """Every item across pages, and the list's resourceVersion (where a following watch starts).

        ``transform`` is applied page by page, so a large list never holds all raw items at once.
        """
        items: builtins.list[Obj] = []
        token: str | None = None
        while True:
            try:
                page = await self.list(
                    kind,
                    namespace,
                    label_selector=label_selector,
                    field_selector=field_selector,
                    limit=page_size,
                    continue_token=token,
                )
            except ApiError as e:
                if not (token and is_gone(e)):
                    raise
                # The continue token outlived etcd compaction; like client-go's pager, fall back to one
                # unpaginated list rather than failing the caller.
                log.info("continue token expired, listing unpaginated", extra={"kind": str(kind)})
                page = await self.list(
                    kind, namespace, label_selector=label_selector, field_selector=field_selector
                )
                return _page_items(page, transform), str(page["metadata"]["resourceVersion"])
            items.extend(_page_items(page, transform))
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion", ""))

    # ------------------------------------------------------------------ writes
    async def create(
        self, kind: ResourceKind, obj: Obj, namespace: str | None = None, *, field_manager: str | None = None
    ) -> Obj:
        ns = namespace or obj.get("metadata", {}).get("namespace")
        body = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        return await self._call(
            "POST", kind.path(ns), _query(fieldManager=self._field_manager(field_manager)), body
        )

    async def replace(
        self,
        kind: ResourceKind,
        obj: Obj,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> Obj:
        """PUT the whole object; a ``metadata.resourceVersion`` in it makes the write conditional."""
        meta = obj.get("metadata") or {}
        body = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        path = kind.path(meta.get("namespace"), meta["name"], subresource)
        return await self._call("PUT", path, _query(fieldManager=self._field_manager(field_manager)), body)

    async def merge_patch(
        self,
        kind: ResourceKind,
        name: str,
        patch: Obj,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> Obj:
        """RFC 7386 merge patch; a ``metadata.resourceVersion`` in the patch makes it conditional."""
        path = kind.path(namespace, name, subresource)
        query = _query(fieldManager=self._field_manager(field_manager))
        return await self._call("PATCH", path, query, patch, _MERGE_PATCH)

    async def json_patch(
        self,
        kind: ResourceKind,
        name: str,
        ops: builtins.list[Obj],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> Obj:
        """RFC 6902 patch; put a ``test`` op first to make it conditional on a value."""
        path = kind.path(namespace, name, subresource)
        query = _query(fieldManager=self._field_manager(field_manager))
        return await self._call("PATCH", path, query, ops, _JSON_PATCH)

    async def apply(
        self,
        kind: ResourceKind,
        obj: Obj,
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
        force: bool = False,
        subresource: str | None = None,
    ) -> Obj:
        """Server-side apply of ``obj`` (which names only the fields this manager owns)."""
        manager = self._field_manager(field_manager)
        if not manager:
            raise ValueError("server-side apply needs a field manager")
        meta = obj.get("metadata") or {}
        body = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        path = kind.path(namespace or meta.get("namespace"), meta["name"], subresource)
        query = _query(fieldManager=manager, force=force or None)
        return await self._call("PATCH", path, query, body, _APPLY_PATCH)

    async def replace_scale(self, kind: ResourceKind, scale: Obj, *, field_manager: str | None = None) -> Obj:
        """PUT an autoscaling/v1 Scale (get_scale's, its spec.replicas changed); its
        ``metadata.resourceVersion`` makes the write conditional, a concurrent write answers 409."""
        meta = scale.get("metadata") or {}
        body = {**scale, "apiVersion": SCALE_API_VERSION, "kind": "Scale"}
        path = kind.path(meta.get("namespace"), meta["name"], "scale")
        return await self._call("PUT", path, _query(fieldManager=self._field_manager(field_manager)), body)

    async def patch_status(
        self, kind: ResourceKind, name: str, status: Obj, namespace: str | None = None
    ) -> Obj:
        """Merge-patch the status subresource with ``{"status": status}``."""
        return await self.merge_patch(kind, name, {"status": status}, namespace, subresource="status")

    async def replace_status(self, kind: ResourceKind, obj: Obj) -> Obj:
        """PUT the status subresource; conditional on the object's resourceVersion."""
        return await self.replace(kind, obj, subresource="status")

    async def delete(
        self,
        kind: ResourceKind,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation_policy: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> Obj:
        """Delete, optionally only if the object still has ``uid``/``resource_version`` (else 409).

        Returns the object (with deletionTimestamp set) while finalizers hold it, else a Status.
        """
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            body["preconditions"] = preconditions
        if propagation_policy:
            body["propagationPolicy"] = propagation_policy
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        return await self._call("DELETE", kind.path(namespace, name), None, body)

    # ------------------------------------------------------------------ watch
    async def watch(
        self,
        kind: ResourceKind,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int | None = None,
        read_timeout: float | None = None,
        allow_bookmarks: bool = True,
    ) -> AsyncGenerator[tuple[str, Obj], None]:
        """Yield ``(type, object)`` until the server ends the watch (``timeout_seconds``).

        ERROR events are raised as ApiError (410 when ``resource_version`` is too old); a silence longer
        than ``read_timeout`` raises TimeoutError.  Close it with ``contextlib.aclosing`` when leaving
        early so the connection is returned at once.
        """
        query = _query(
            watch=True,
            allowWatchBookmarks=allow_bookmarks or None,
            resourceVersion=resource_version,
            labelSelector=label_selector,
            fieldSelector=field_selector,
            timeoutSeconds=timeout_seconds,
        )
        # (connect, per-read) rather than a total: a healthy watch runs for minutes.
        read = read_timeout if read_timeout is not None else (timeout_seconds or 300) + 30
        resp = await self._open(
            "GET", kind.path(namespace), query, request_timeout=(self.request_timeout, read)
        )
        try:
            # Objects can exceed aiohttp's readline() limit, so lines are split here.
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                # Only the new chunk can hold a newline: earlier bytes were searched already.
                nl = chunk.find(b"\n")
                nl = nl + len(buf) if nl >= 0 else -1
                buf += chunk
                while nl >= 0:
                    line = bytes(buf[:nl])
                    del buf[: nl + 1]
                    if line.strip():
                        yield _watch_event(line)
                    nl = buf.find(b"\n")
            if buf.strip():
                yield _watch_event(bytes(buf))
        finally:
            resp.close()


def _page_items(page: Obj, transform: Callable[[Obj], Obj] | None) -> list[Obj]:
    raw: list[Obj] = page.pop("items", None) or []
    return [transform(item) for item in raw] if transform else raw


def _watch_event(line: bytes) -> tuple[str, Obj]:
    event = json.loads(line)
    etype, obj = event.get("type"), event.get("object")
    if etype == "ERROR":
        raise ApiError.from_status(obj or {}, 500)
    if not isinstance(etype, str) or not isinstance(obj, dict):
        raise ApiError(500, "BadWatchEvent", line[:200].decode("utf-8", "replace"))
    return etype, obj


def object_key(obj: Mapping[str, Any]) -> str:
    """client-go's MetaNamespaceKey: "namespace/name", or just "name" for cluster-scoped objects."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta['name']}" if ns else str(meta["name"])


def controller_ref(obj: Mapping[str, Any]) -> dict[str, str] | None:
    """The object's controller ownerReference (its string fields), or None: what manages it."""
    return Meta(obj).controller
