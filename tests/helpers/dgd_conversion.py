"""The session cluster's DynamoGraphDeployment CRD made to serve every version (v1alpha1 beside the stored
v1beta1), converted by a webhook this process runs, as the chart points the CRD at the controller's
Service; put back as ``crds/`` holds it (v1beta1 alone served) after. Storage stays v1beta1 throughout,
so the DGDs written meanwhile need no migration either way.

``every_version_served`` runs the controller's WebhookServer on the test's own event loop (async tests,
whose kubectl calls go off the loop); ``every_version_served_sync`` runs the conversion handler in a
thread of its own (sync tests, which call kubectl directly), and backs the ``v1alpha1_served`` fixture.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.controller.dynamo.conversion_webhook import handle_convert
from dynamo_snapshot.controller.webhook_server import CERT_FILE, CONVERSION_PATH, KEY_FILE, WebhookServer
from dynamo_snapshot.kube import Kube
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.dgd_crd import served
from tests.helpers.polling import wait_for
from tests.helpers.webhook import Certs, make_certs, serving, until

Obj = dict[str, Any]
DGD_CRD = "dynamographdeployments.nvidia.com"
_SERVER_FIELDS = ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields")


def served_crd(url: str, ca: bytes) -> Obj:
    """The generated DGD CRD, every version served, converted by the webhook at ``url``."""
    crd = crdgen.generated_crd(DynamoGraphDeployment)
    for version in crd["spec"]["versions"]:
        version["served"] = True
    crd["spec"]["conversion"]["webhook"]["clientConfig"] = {
        "url": url,
        "caBundle": base64.b64encode(ca).decode(),
    }
    return crd


def current_crd(cluster: LocalCluster) -> Obj:
    crd: Obj = json.loads(cluster.kubectl("get", "crd", DGD_CRD, "-o", "json").stdout)
    for key in _SERVER_FIELDS:
        crd["metadata"].pop(key, None)
    crd.pop("status", None)
    return crd


def _served_versions(crd: Obj) -> dict[str, bool]:
    return {v["name"]: bool(v.get("served")) for v in crd["spec"]["versions"]}


async def kubectl(
    cluster: LocalCluster, *args: str, body: Obj | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl off the event loop: the webhook the apiserver calls meanwhile runs on it."""
    text = json.dumps(body) if body is not None else None
    return await asyncio.to_thread(cluster.kubectl, *args, input=text, check=False)


def _is_served(cluster: LocalCluster, version: str) -> bool:
    return served(cluster, version)


async def _served(cluster: LocalCluster, version: str) -> bool:
    return await asyncio.to_thread(_is_served, cluster, version)


@contextlib.asynccontextmanager
async def every_version_served(
    cluster: LocalCluster, kube: Kube, namespace: str, tmp: Path
) -> AsyncIterator[WebhookServer]:
    """Inside: v1alpha1 DGDs are served too, converted by this process's webhook. On the way out the DGDs
    of ``namespace`` are deleted (while the webhook still answers), then the cluster's CRD is put back."""
    certs = make_certs(tmp)
    before = current_crd(cluster)
    async with serving(kube, certs.directory, reload_interval_s=0.2) as (server, _):
        await until(lambda: server.readiness() is None, "the webhook to listen")
        url = f"https://127.0.0.1:{server.port}{CONVERSION_PATH}"
        await kubectl(cluster, "replace", "-f", "-", body=served_crd(url, certs.ca))
        try:
            await until(lambda: _served(cluster, "v1alpha1"), "v1alpha1 DGDs served")
            yield server
        finally:
            await kubectl(
                cluster, "delete", DGD_CRD, "--all", "-n", namespace, "--wait=true", "--timeout=60s"
            )
            await kubectl(cluster, "replace", "-f", "-", body=before)
            served = _served_versions(before)

            async def as_before() -> bool:
                for version in ("v1alpha1", "v1beta1"):
                    if await _served(cluster, version) != served.get(version, False):
                        return False
                return True

            await until(as_before, "the DGD versions served as before", within=60)


@contextlib.contextmanager
def _conversion_thread(certs: Certs) -> Iterator[int]:
    """The conversion handler (controller/dynamo/conversion_webhook.py) served over TLS on 127.0.0.1 by a
    thread of its own; yields its port."""
    started = threading.Event()
    state: dict[str, Any] = {}
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        app = web.Application()
        app.router.add_post(CONVERSION_PATH, handle_convert)
        runner = web.AppRunner(app)
        await runner.setup()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certs.directory / CERT_FILE, certs.directory / KEY_FILE)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, ssl_context=context).start()
        state["port"] = sock.getsockname()[1]
        state["stop"] = stop = asyncio.Event()
        started.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not started.wait(30):
        raise AssertionError("the conversion webhook thread did not start")
    try:
        yield int(state["port"])
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def every_version_served_sync(cluster: LocalCluster, tmp: Path) -> Iterator[None]:
    """Inside: v1alpha1 DGDs are served too, converted by a thread of this process. The DGDs written
    meanwhile stay (stored at v1beta1, they are read after without a webhook)."""
    certs = make_certs(tmp)
    before = current_crd(cluster)
    with _conversion_thread(certs) as port:
        url = f"https://127.0.0.1:{port}{CONVERSION_PATH}"
        cluster.kubectl("replace", "-f", "-", input=json.dumps(served_crd(url, certs.ca)))
        try:
            wait_for(lambda: _is_served(cluster, "v1alpha1"), within=30, what="v1alpha1 DGDs served")
            yield
        finally:
            cluster.kubectl("replace", "-f", "-", input=json.dumps(before))
            served = _served_versions(before)
            wait_for(
                lambda: all(_is_served(cluster, v) == served.get(v, False) for v in ("v1alpha1", "v1beta1")),
                within=60,
                what="the DGD versions served as before",
            )
