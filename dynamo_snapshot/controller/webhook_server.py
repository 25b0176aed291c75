"""The controller's webhooks, served over HTTPS by every controller replica: the restore mutating
admission webhook (below) and the DynamoGraphDeployment conversion webhook (``conversion_webhook``).

The apiserver POSTs an AdmissionReview for each pod created with ``nvidia.com/restore-from`` (the
MutatingWebhookConfiguration's matchConditions send no other pod). The server reads what the annotation
names with a direct GET in the pod's namespace (a DynamoCheckpoint, else a PodSnapshot and its bound
PodSnapshotContent): a cache could be behind a PodSnapshot created a moment before its restore pod, and
only the leader keeps caches while every replica serves admissions. ``restore_mutation`` decides.

The TLS certificate and key are read from ``tls.crt`` and ``tls.key`` in a directory (a mounted
kubernetes.io/tls Secret) and read again whenever they change, so a rotated certificate is served
without a restart; a connection gets the pair current when it starts its handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import ssl
from pathlib import Path
from typing import Final

from aiohttp import web
from pydantic import ValidationError

from dynamo_snapshot.api.admission import AdmissionRequest, AdmissionResponse, AdmissionReview, allow, deny
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.views import Meta, PodSnapshotView
from dynamo_snapshot.controller.dynamo.conversion_webhook import CONVERSION_PATH, handle_convert
from dynamo_snapshot.controller.snapshot.restore_mutation import Found, mutate, name_problem, requested_name
from dynamo_snapshot.kube import ApiError, Kube, Obj
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot.kube.until_written import get_or_none

__all__ = ["CERT_FILE", "CONVERSION_PATH", "KEY_FILE", "MUTATE_PATH", "WebhookServer"]

log = logging.getLogger(__name__)

MUTATE_PATH: Final = "/mutate-restore-pods"
CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
# The apiserver waits timeoutSeconds (10 in the chart) for the whole answer; the lookups get most of it.
LOOKUP_TIMEOUT_S: Final = 6.0
# A pod is at most about 1.5 MB in etcd; an AdmissionReview carries it once. A ConversionReview carries
# a list's objects, up to its page of 500 DGDs (each at most the same 1.5 MB, far less in practice).
MAX_REQUEST_BYTES: Final = 64 * 1024 * 1024
_SHUTDOWN_TIMEOUT_S: Final = 2.0


def _read_pair(cert: Path, key: Path) -> tuple[str, ssl.SSLContext]:
    """(digest of both files, a server context serving them); OSError or ssl.SSLError when unusable."""
    digest = hashlib.sha256(cert.read_bytes() + b"\0" + key.read_bytes()).hexdigest()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return digest, context


class WebhookServer:
    """Serves ``MUTATE_PATH`` on ``host:port`` (host None: every interface; port 0: an ephemeral one,
    ``.port`` says which) with the certificate in ``cert_dir``, looked at every ``reload_interval_s``."""

    def __init__(
        self,
        kube: Kube,
        cert_dir: Path,
        port: int,
        *,
        host: str | None = None,
        reload_interval_s: float = 10.0,
        passes_by: bool = False,
    ) -> None:
        self.kube = kube
        # Another operator runs PodSnapshots and shapes restore-from pods itself: all pass unchanged.
        self.passes_by = passes_by
        self.cert_file = cert_dir / CERT_FILE
        self.key_file = cert_dir / KEY_FILE
        self.requested_port = port
        self.host = host
        self.reload_interval_s = reload_interval_s
        self._digest: str | None = None
        self._context: ssl.SSLContext | None = None
        self._runner: web.AppRunner | None = None
        self._problem = "webhook: not started"
        self.reviews = 0  # answered AdmissionReviews, for tests and logs

    @property
    def port(self) -> int:
        addresses = self._runner.addresses if self._runner is not None else []
        if not addresses:
            raise RuntimeError("webhook server is not listening")
        return int(addresses[0][1])

    def readiness(self) -> str | None:
        """None while the webhook serves; else why not (a replica that cannot admit is not ready)."""
        return None if self._runner is not None else self._problem

    async def run_until(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, reading the certificate again whenever it changes; until a
        usable one is there, nothing listens and ``readiness`` says why."""
        try:
            while not stop.is_set():
                await self.reload()
                if self._runner is None and self._context is not None:
                    await self._listen(self._context)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.reload_interval_s)
        finally:
            await self.close()

    async def reload(self) -> bool:
        """Read the certificate and key again; True when a changed, usable pair is now served."""
        try:
            digest, context = await asyncio.to_thread(_read_pair, self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            problem = f"webhook: no usable TLS certificate in {self.cert_file.parent}: {e}"
            if problem != self._problem:
                log.warning(
                    "webhook certificate unusable", extra={"error": str(e), "dir": str(self.cert_file.parent)}
                )
            self._problem = problem
            return False
        if digest == self._digest:
            return False
        # Every connection starts on the first context; its callback hands the handshake the newest.
        context.sni_callback = self._current_context
        self._digest, self._context = digest, context
        self._problem = "webhook: not listening yet"
        log.info("webhook certificate loaded", extra={"cert": str(self.cert_file), "digest": digest[:12]})
        return True

    def _current_context(self, sslobj: ssl.SSLObject, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        if self._context is not None:
            sslobj.context = self._context

    async def _listen(self, context: ssl.SSLContext) -> None:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post(MUTATE_PATH, self._handle)
        app.router.add_post(CONVERSION_PATH, handle_convert)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        # Every interface first; IPv4 alone where the pod's IPv6 is switched off and `::` cannot be bound.
        hosts = [self.host] if self.host else [None, "0.0.0.0"]
        try:
            for i, host in enumerate(hosts):
                try:
                    await web.TCPSite(runner, host, self.requested_port, ssl_context=context).start()
                    break
                except OSError:
                    if i == len(hosts) - 1:
                        raise
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("webhook listening", extra={"port": self.port, "paths": [MUTATE_PATH, CONVERSION_PATH]})

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self._problem = "webhook: stopped"
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            review = AdmissionReview.model_validate(json.loads(await request.read()))
        except (ValueError, ValidationError) as e:
            why = validation_message(e) if isinstance(e, ValidationError) else str(e)
            return web.json_response(
                {"error": f"not an admission.k8s.io/v1 AdmissionReview: {why}"}, status=400
            )
        if review.request is None:
            return web.json_response({"error": "the AdmissionReview has no request"}, status=400)
        response = await self.review(review.request)
        self.reviews += 1
        return web.json_response(review.answer(response))

    async def review(self, req: AdmissionRequest) -> AdmissionResponse:
        """The answer to one admission request."""
        pod = req.object or {}
        name = requested_name(pod)
        if req.kind.kind != "Pod" or req.operation != "CREATE" or name is None or self.passes_by:
            return allow(req.uid)
        namespace = req.namespace or Meta(pod).namespace
        where = {"namespace": namespace, "pod": _pod_name(pod), "restore_from": name}
        problem = name_problem(name, namespace)
        if problem:
            log.info("restore pod refused", extra={**where, "reason": problem})
            return deny(req.uid, problem)
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                found = await self._lookup(name, namespace)
        except (ApiError, TimeoutError) as e:
            why = (
                f"{e.reason}: {e.message}"
                if isinstance(e, ApiError)
                else f"no answer in {LOOKUP_TIMEOUT_S:g}s"
            )
            message = (
                f"cannot read what nvidia.com/restore-from={name!r} names in namespace {namespace} ({why})"
            )
            log.warning("restore pod refused: lookup failed", extra={**where, "error": why})
            return deny(req.uid, message, code=500, reason="InternalError")
        outcome = mutate(pod, namespace, found)
        if outcome.denied:
            log.info("restore pod refused", extra={**where, "reason": outcome.denied})
            return deny(req.uid, outcome.denied)
        log.info(
            "restore pod shaped",
            extra={
                **where,
                "containers": list(outcome.targets),
                "ops": len(outcome.patch),
                "warnings": outcome.warnings,
            },
        )
        return allow(req.uid, outcome.patch, outcome.warnings)

    async def _lookup(self, name: str, namespace: str) -> Found:
        """A DynamoCheckpoint of the name wins, as in the node agent; else a PodSnapshot and its content."""
        checkpoint = await get_or_none(self.kube, CHECKPOINT, name, namespace)
        if checkpoint is not None:
            return Found(checkpoint=checkpoint)
        snapshot = await get_or_none(self.kube, POD_SNAPSHOT, name, namespace)
        bound = PodSnapshotView(snapshot).bound_content if snapshot is not None else ""
        content = await get_or_none(self.kube, POD_SNAPSHOT_CONTENT, bound, None) if bound else None
        return Found(snapshot=snapshot, content=content)


def _pod_name(pod: Obj) -> str:
    meta = Meta(pod)
    return meta.name or f"{meta.generate_name}*"
