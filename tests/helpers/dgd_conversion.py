"""The session cluster's DynamoGraphDeployment CRD swapped, inside a block, for the generated two-version
one with v1beta1 served and its conversion webhook pointed (url and caBundle) at a WebhookServer this
process runs, as the chart points it at the controller's Service; the CRD the cluster had is put back
after. Storage stays v1alpha1 throughout, so the DGDs other tests stored need no migration either way.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.controller.webhook_server import CONVERSION_PATH, WebhookServer
from dynamo_snapshot.kube import Kube
from dynamo_snapshot.localcluster import LocalCluster
from tests.helpers.webhook import make_certs, serving, until

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


async def kubectl(
    cluster: LocalCluster, *args: str, body: Obj | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl off the event loop: the webhook the apiserver calls meanwhile runs on it."""
    text = json.dumps(body) if body is not None else None
    return await asyncio.to_thread(cluster.kubectl, *args, input=text, check=False)


async def _served(cluster: LocalCluster, version: str, namespace: str) -> bool:
    proc = await kubectl(cluster, "get", f"dynamographdeployments.{version}.nvidia.com", "-n", namespace)
    return proc.returncode == 0


@contextlib.asynccontextmanager
async def v1beta1_served(
    cluster: LocalCluster, kube: Kube, namespace: str, tmp: Path
) -> AsyncIterator[WebhookServer]:
    """Inside: v1beta1 DGDs are served, converted by this process's webhook. On the way out the DGDs of
    ``namespace`` are deleted (while the webhook still answers), then the cluster's CRD is put back."""
    certs = make_certs(tmp)
    before = current_crd(cluster)
    async with serving(kube, certs.directory, reload_interval_s=0.2) as (server, _):
        await until(lambda: server.readiness() is None, "the webhook to listen")
        url = f"https://127.0.0.1:{server.port}{CONVERSION_PATH}"
        await kubectl(cluster, "replace", "-f", "-", body=served_crd(url, certs.ca))
        try:
            await until(lambda: _served(cluster, "v1beta1", namespace), "v1beta1 DGDs served")
            yield server
        finally:
            await kubectl(
                cluster, "delete", DGD_CRD, "--all", "-n", namespace, "--wait=true", "--timeout=60s"
            )
            await kubectl(cluster, "replace", "-f", "-", body=before)
            served = {v["name"]: bool(v.get("served")) for v in before["spec"]["versions"]}

            async def as_before() -> bool:
                for version in ("v1alpha1", "v1beta1"):
                    if await _served(cluster, version, namespace) != served.get(version, False):
                        return False
                return True

            await until(as_before, "the DGD versions served as before", within=60)
