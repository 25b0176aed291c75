"""The restore webhook of this test process, registered with the real kube-apiserver the way the chart
registers it (its url and caBundle pointed at this process, its namespaceSelector at one namespace): shared
by the webhook's own tests and the kubelet-node tests that create plain restore-from pods."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.webhook_server import CERT_FILE, KEY_FILE, MUTATE_PATH, WebhookServer
from dynamo_snapshot.kube import ApiError, Kube, Obj, ResourceKind, is_not_found
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.pki import make_pki
from tests.helm.chart import one, render

WEBHOOK_CONFIG = ResourceKind(
    "admissionregistration.k8s.io",
    "v1",
    "mutatingwebhookconfigurations",
    "MutatingWebhookConfiguration",
    namespaced=False,
)
SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")


@dataclass(frozen=True)
class Certs:
    directory: Path  # tls.crt and tls.key, as the chart mounts them
    ca: bytes


def make_certs(root: Path) -> Certs:
    """A CA and a serving certificate for 127.0.0.1 (what the apiserver dials), with openssl."""
    pki = make_pki(root / "pki", ["127.0.0.1"])
    directory = root / "serving"
    directory.mkdir(parents=True)
    shutil.copy(pki.server_cert, directory / CERT_FILE)
    shutil.copy(pki.server_key, directory / KEY_FILE)
    return Certs(directory, pki.ca_cert.read_bytes())


@contextlib.asynccontextmanager
async def serving(kube: Kube, certs: Path, **kw: Any) -> AsyncIterator[tuple[WebhookServer, asyncio.Event]]:
    server = WebhookServer(kube, certs, 0, host="127.0.0.1", **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run_until(stop))
    try:
        yield server, stop
    finally:
        stop.set()
        await task


async def until(cond: Any, what: str, within: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


def probe_pod(name: str, restore_from: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {protocol.ANNOTATION_RESTORE_FROM: restore_from}},
        "spec": {
            "nodeSelector": {"dynamo-snapshot.test/nowhere": "true"},
            "containers": [{"name": "main", "image": "worker:1"}, {"name": "sidecar", "image": "proxy:1"}],
        },
    }


@dataclass
class Registered:
    server: WebhookServer
    stop: asyncio.Event
    name: str  # the configuration's
    webhook: str  # the webhook's name in it


@contextlib.asynccontextmanager
async def registered_webhook(
    cluster: LocalCluster, kube: Kube, namespace: str, certs: Certs
) -> AsyncIterator[Registered]:
    """This process's webhook, registered with the apiserver as the chart registers it, for ``namespace``,
    and in effect (a dry-run restore pod comes back shaped) when this yields."""
    chart = one(render({"webhook": {"enabled": True}}), "MutatingWebhookConfiguration")
    config = json.loads(json.dumps(chart))
    config["metadata"] = {"name": f"restore-{namespace}"}
    hook = config["webhooks"][0]
    async with serving(kube, certs.directory, reload_interval_s=0.2) as (server, stop):
        await until(lambda: server.readiness() is None, "the webhook to listen")
        hook["clientConfig"] = {
            "url": f"https://127.0.0.1:{server.port}{MUTATE_PATH}",
            "caBundle": base64.b64encode(certs.ca).decode(),
        }
        hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        await kube.create(WEBHOOK_CONFIG, config)
        try:
            await until(
                lambda: _exists(kube, SERVICE_ACCOUNT, "default", namespace), "the default ServiceAccount"
            )
            await _until_in_effect(cluster, namespace)
            yield Registered(server, stop, config["metadata"]["name"], hook["name"])
        finally:
            await kube.delete(WEBHOOK_CONFIG, config["metadata"]["name"])


async def _exists(kube: Kube, kind: ResourceKind, name: str, namespace: str) -> bool:
    try:
        await kube.get(kind, name, namespace)
    except ApiError as e:
        if is_not_found(e):
            return False
        raise
    return True


async def _until_in_effect(cluster: LocalCluster, namespace: str) -> None:
    """The apiserver picks a new configuration up a moment after it is stored: dry-run restore pods until
    one comes back shaped."""

    async def shaped() -> bool:
        proc = await asyncio.to_thread(
            cluster.kubectl, "create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-",
            input=json.dumps(probe_pod("probe", "probe")), check=False,
        )  # fmt: skip
        labels = json.loads(proc.stdout or "{}").get("metadata", {}).get("labels") or {}
        return labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE

    await until(shaped, "the webhook configuration to take effect")
