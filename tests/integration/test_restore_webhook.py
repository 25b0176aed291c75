"""The restore webhook served by this process, called by the real kube-apiserver of the `cluster` fixture
through the MutatingWebhookConfiguration the chart renders (its url and caBundle pointed at this server,
its namespaceSelector at the test's namespace only): a restore-from pod is stored shaped, a plain pod never
reaches the server, a missing snapshot is admitted with the warning on standby, another namespace's name is
refused with the reason, and with the server down a restore-from pod is refused naming the webhook while a
plain pod is still admitted. Pods are created with kubectl (its warnings are the apiserver's), off the
event loop that serves the webhook."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.controller.webhook_server import CERT_FILE, KEY_FILE, MUTATE_PATH
from dynamo_snapshot.kube import Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT_CONTENT
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.cluster import free_port
from tests.helpers.cli import CLI
from tests.helpers.polling import wait_for
from tests.helpers.ready_snapshot import ready_snapshot
from tests.helpers.webhook import (
    Certs,
    Registered,
    make_certs,
    probe_pod,
    registered_webhook,
    serving,
    until,
)


def plain_pod(name: str, **annotations: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        # Never scheduled: the test reads what the apiserver stored, nothing runs.
        "spec": {
            "nodeSelector": {"dynamo-snapshot.test/nowhere": "true"},
            "containers": [{"name": "main", "image": "worker:1"}, {"name": "sidecar", "image": "proxy:1"}],
        },
    }


def restore_pod(name: str, restore_from: str) -> Obj:
    return probe_pod(name, restore_from)


async def kubectl_create(cluster: LocalCluster, namespace: str, pod: Obj) -> subprocess.CompletedProcess[str]:
    # Off the loop: the webhook that answers the apiserver runs on it.
    return await asyncio.to_thread(
        cluster.kubectl,
        "create",
        "-n",
        namespace,
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(pod),
        check=False,
    )


def stored(proc: subprocess.CompletedProcess[str]) -> Obj:
    assert proc.returncode == 0, proc.stderr
    pod: Obj = json.loads(proc.stdout)
    return pod


def env_of(pod: Obj, container: str) -> dict[str, str]:
    c = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    return {e["name"]: e.get("value", "") for e in c.get("env") or []}


# --------------------------------------------------------------------------- the apiserver calls it


@pytest.fixture
async def kube(api: client.ApiClient) -> Kube:
    return Kube(api, field_manager="restore-webhook-test")


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@pytest.fixture
async def registered(
    cluster: LocalCluster, crds: list[str], namespace: str, kube: Kube, certs: Certs
) -> AsyncIterator[Registered]:
    """This process's webhook, registered with the apiserver as the chart registers it, for ``namespace``."""
    async with registered_webhook(cluster, kube, namespace, certs) as reg:
        yield reg


@pytest.mark.cluster
async def test_a_restore_from_pod_is_stored_shaped_for_the_agent(
    cluster: LocalCluster, namespace: str, kube: Kube, registered: Registered
) -> None:
    snap = await ready_snapshot(kube, namespace, "snap-a")
    try:
        proc = await kubectl_create(cluster, namespace, restore_pod("restored", "snap-a"))
        pod = stored(proc)
        assert "Warning" not in proc.stderr, proc.stderr
        labels = pod["metadata"]["labels"]
        assert labels[protocol.LABEL_RESTORE_TARGET] == protocol.TRUE
        assert labels[protocol.LABEL_CHECKPOINT_ID] == "snap-a"
        assert {"conditionType": protocol.POD_CONDITION_RESTORED} in pod["spec"]["readinessGates"]
        assert {"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}} in pod["spec"]["volumes"]
        env = env_of(pod, "main")
        assert env[protocol.ENV_CONTROL_DIR] == protocol.CONTROL_MOUNT_PATH
        assert all(env[n] == "1" for n in protocol.ENV_RESTORE_STANDBYS)
        main = pod["spec"]["containers"][0]
        assert {
            "name": protocol.CONTROL_VOLUME_NAME,
            "mountPath": protocol.CONTROL_MOUNT_PATH,
            "subPath": "main",
        } in main["volumeMounts"]
        assert env_of(pod, "sidecar") == {}
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [
            {
                "matchExpressions": [
                    {"key": protocol.LABEL_GPU_PRODUCT, "operator": "In", "values": ["NVIDIA-H200"]},
                    {"key": protocol.LABEL_CUDA_DRIVER_MAJOR, "operator": "In", "values": ["570"]},
                    {"key": protocol.LABEL_GPU_COUNT, "operator": "Gt", "values": ["0"]},
                ]
            }
        ]
    finally:
        await kube.delete(POD_SNAPSHOT_CONTENT, content_name(snap["metadata"]["uid"]))


@pytest.mark.cluster
async def test_a_pod_without_the_annotation_never_reaches_the_webhook(
    cluster: LocalCluster, namespace: str, registered: Registered
) -> None:
    before = registered.server.reviews
    pod = stored(await kubectl_create(cluster, namespace, plain_pod("plain", note="x")))
    assert registered.server.reviews == before
    assert "labels" not in pod["metadata"]
    assert "readinessGates" not in pod["spec"]
    assert all("env" not in c for c in pod["spec"]["containers"])


@pytest.mark.cluster
async def test_a_missing_snapshot_is_admitted_with_the_warning_and_waits_on_standby(
    cluster: LocalCluster, namespace: str, registered: Registered
) -> None:
    proc = await kubectl_create(cluster, namespace, restore_pod("early", "not-yet"))
    pod = stored(proc)
    assert f"no DynamoCheckpoint or PodSnapshot named 'not-yet' in namespace {namespace}" in proc.stderr
    assert f"{protocol.POD_CONDITION_RESTORED}=False" in proc.stderr
    assert all(env_of(pod, "main")[n] == "1" for n in protocol.ENV_RESTORE_STANDBYS)
    assert pod["metadata"]["labels"][protocol.LABEL_CHECKPOINT_ID] == "not-yet"
    assert "affinity" not in pod["spec"]


@pytest.mark.cluster
async def test_another_namespaces_snapshot_is_refused_with_the_reason(
    cluster: LocalCluster, namespace: str, kube: Kube, registered: Registered
) -> None:
    proc = await kubectl_create(cluster, namespace, restore_pod("cross", "other/x"))
    assert proc.returncode != 0, proc.stdout
    assert f'admission webhook "{registered.webhook}" denied the request' in proc.stderr, proc.stderr
    assert "there is no cross-namespace restore" in proc.stderr


@pytest.mark.cluster
async def test_with_the_webhook_down_restore_pods_are_refused_and_other_pods_admitted(
    cluster: LocalCluster, namespace: str, registered: Registered
) -> None:
    registered.stop.set()
    await until(lambda: registered.server.readiness() is not None, "the webhook to stop")
    proc = await kubectl_create(cluster, namespace, restore_pod("while-down", "snap-a"))
    assert proc.returncode != 0, proc.stdout
    assert f'failed calling webhook "{registered.webhook}"' in proc.stderr, proc.stderr
    plain = stored(await kubectl_create(cluster, namespace, plain_pod("plain-while-down")))
    assert plain["metadata"]["name"] == "plain-while-down"


# --------------------------------------------------------------------------- the server itself


def served_cert(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


async def test_the_certificate_is_waited_for_and_a_rotated_one_served_without_a_restart(
    tmp_path: Path,
) -> None:
    a, b = make_certs(tmp_path / "a"), make_certs(tmp_path / "b")
    live = tmp_path / "live"
    live.mkdir()
    async with (
        client.ApiClient(client.Configuration()) as unused,  # nothing here is looked up
        serving(Kube(unused), live, reload_interval_s=0.1) as (server, _),
    ):
        await until(
            lambda: "no usable TLS certificate" in (server.readiness() or ""), "the missing cert reported"
        )
        for name in (CERT_FILE, KEY_FILE):
            shutil.copy(a.directory / name, live / name)
        await until(lambda: server.readiness() is None, "the webhook to listen once the cert is there")
        assert await asyncio.to_thread(served_cert, server.port) == pem_to_der(a.directory / CERT_FILE)

        for name in (CERT_FILE, KEY_FILE):
            shutil.copy(b.directory / name, live / name)

        async def serves_b() -> bool:
            return await asyncio.to_thread(served_cert, server.port) == pem_to_der(b.directory / CERT_FILE)

        await until(serves_b, "the rotated certificate to be served")
        # A pair that does not match is not taken: the last good one is still served.
        shutil.copy(a.directory / KEY_FILE, live / KEY_FILE)
        await asyncio.sleep(0.5)
        assert server.readiness() is None
        assert await serves_b()


async def test_what_is_not_a_restore_create_is_allowed_unchanged_and_garbage_is_a_400(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    async with (
        client.ApiClient(client.Configuration()) as unused,  # nothing here is looked up
        serving(Kube(unused), certs.directory) as (server, _),
    ):
        await until(lambda: server.readiness() is None, "the webhook to listen")
        context = ssl.create_default_context(cadata=certs.ca.decode())
        url = f"https://127.0.0.1:{server.port}{MUTATE_PATH}"
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "operation": "UPDATE",
                "namespace": "ns",
                "object": restore_pod("p", "other/x"),
            },
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=review, ssl=context) as resp:
                assert resp.status == 200
                assert await resp.json() == {
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "response": {"uid": "u-1", "allowed": True},
                }
            review["request"]["operation"] = "CREATE"
            async with session.post(url, json=review, ssl=context) as resp:
                answer = (await resp.json())["response"]
                assert answer["allowed"] is False
                assert "there is no cross-namespace restore" in answer["status"]["message"]
            async with session.post(url, data=b"{not json", ssl=context) as resp:
                assert resp.status == 400
                assert "not an admission.k8s.io/v1 AdmissionReview" in (await resp.json())["error"]


# --------------------------------------------------------------------------- the controller process


def _get(url: str, context: ssl.SSLContext | None = None, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


@pytest.mark.cluster
def test_the_controller_process_serves_the_webhook_and_is_ready_only_once_it_does(
    cluster: LocalCluster, namespace: str, crds: list[str], tmp_path: Path
) -> None:
    certs = make_certs(tmp_path / "certs")
    live = tmp_path / "live"
    live.mkdir()
    health, webhook = free_port(), free_port()
    args = [*CLI, "controller", "--namespace", namespace, "--no-leader-elect", "--metrics-port", "0"]
    args += ["--health-port", str(health), "--webhook-port", str(webhook), "--webhook-cert-dir", str(live)]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    with (tmp_path / "controller.log").open("w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=log)
        try:
            readyz = f"http://127.0.0.1:{health}/readyz"
            status, body = wait_for(
                lambda: (r := _get(readyz))[0] == 503 and "TLS" in r[1] and r, 30, "/readyz"
            )
            assert f"no usable TLS certificate in {live}" in body
            for name in (CERT_FILE, KEY_FILE):
                shutil.copy(certs.directory / name, live / name)
            wait_for(lambda: _get(readyz)[0] == 200, 30, "/readyz to pass once the webhook serves")
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "u-1",
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "operation": "CREATE",
                    "namespace": namespace,
                    "object": restore_pod("p", "other/x"),
                },
            }
            context = ssl.create_default_context(cadata=certs.ca.decode())
            url = f"https://127.0.0.1:{webhook}{MUTATE_PATH}"
            status, body = _get(url, context, json.dumps(review).encode())
            assert status == 200, body
            answer = json.loads(body)["response"]
            assert answer["uid"] == "u-1"
            assert answer["allowed"] is False
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
