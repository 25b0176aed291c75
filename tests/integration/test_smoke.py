"""Proof that the test bed is real: a CRD served by kube-apiserver, watched through kubernetes-asyncio,
a pod placed by kube-scheduler on a kwok GPU node and run by kwok, and a CRIU dump/restore of a process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, watch

from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.polling import wait_file

SMOKE_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.smoke.dynamo-snapshot.dev}
spec:
  group: smoke.dynamo-snapshot.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer, minimum: 1}
"""
GROUP, VERSION, PLURAL = "smoke.dynamo-snapshot.dev", "v1", "widgets"


@pytest.mark.cluster
async def test_crd_create_watch_patch(cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    cluster.apply(SMOKE_CRD)
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/widgets.smoke.dynamo-snapshot.dev"
    )
    co = client.CustomObjectsApi(api)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 1},
    }
    created = await co.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    rv = created["metadata"]["resourceVersion"]

    async def patch_soon() -> None:
        await asyncio.sleep(0.3)
        await co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "w1",
            {"spec": {"size": 3}},
            _content_type="application/merge-patch+json",
        )

    task = asyncio.create_task(patch_soon())
    seen: list[tuple[str, int]] = []
    w = watch.Watch()
    async with asyncio.timeout(30):
        async for ev in w.stream(
            co.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            resource_version=rv,
            timeout_seconds=20,
        ):
            seen.append((ev["type"], ev["object"]["spec"]["size"]))
            if ev["type"] == "MODIFIED":
                break
    await task
    assert seen[-1] == ("MODIFIED", 3)

    # The apiserver enforces the schema, so the bed really validates like production.
    bad = {**body, "metadata": {"name": "w2"}, "spec": {"size": 0}}
    with pytest.raises(client.ApiException) as err:
        await co.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert err.value.status == 422
    assert "spec.size" in err.value.body


@pytest.mark.cluster
async def test_gpu_pod_scheduled_and_running(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    node = gpu_node(product="NVIDIA-H200", gpus=2)
    name = node["metadata"]["name"]
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-worker"},
        "spec": {
            "containers": [
                {"name": "w", "image": "worker:test", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200", "kubernetes.io/hostname": name},
        },
    }
    await core.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p = await core.read_namespaced_pod("gpu-worker", namespace)
        if p.spec.node_name and p.status.phase == "Running":
            break
        await asyncio.sleep(0.25)
    assert p.spec.node_name == name, "kube-scheduler did not bind the pod to the kwok GPU node"
    assert p.status.phase == "Running", "kwok did not run the pod"
    n = await core.read_node(name)
    assert n.status.allocatable["nvidia.com/gpu"] == "2"
    assert any(c.type == "Ready" and c.status == "True" for c in n.status.conditions)

    # A pod asking for more GPUs than any node has stays Pending with a scheduler reason.
    greedy = {**pod, "metadata": {"name": "greedy"}}
    greedy["spec"] = {
        **pod["spec"],
        "containers": [
            {"name": "w", "image": "worker:test", "resources": {"limits": {"nvidia.com/gpu": "64"}}}
        ],
    }
    await core.create_namespaced_pod(namespace, greedy)
    deadline = time.monotonic() + 30
    reason = ""
    while time.monotonic() < deadline and not reason:
        g = await core.read_namespaced_pod("greedy", namespace)
        reason = next((c.message or "" for c in g.status.conditions or [] if c.type == "PodScheduled"), "")
        await asyncio.sleep(0.25)
    assert "nvidia.com/gpu" in reason


STATEFUL_PROCESS = r"""
import hashlib, os, sys, time
d = sys.argv[1]
state = bytearray(os.urandom(32 << 20))          # 32 MiB of state that exists only in memory

def publish(name, text):
    # Written whole then renamed: the test must never read a file that exists but is still empty.
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))

publish("before", hashlib.sha256(state).hexdigest())
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
publish("after", f"{hashlib.sha256(state).hexdigest()} {os.getpid()}")
"""


@pytest.mark.criu
def test_criu_dump_restore_keeps_memory(criu_bin: Path, tmp_path: Path) -> None:
    version = subprocess.run([str(criu_bin), "--version"], capture_output=True, text=True, check=True).stdout
    major = int(version.split("Version:")[1].strip().split(".")[0])
    assert major >= 4, version

    work, images = tmp_path / "work", tmp_path / "images"
    work.mkdir()
    images.mkdir()
    log = (work / "stdout").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", STATEFUL_PROCESS, str(work)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    before = wait_file(work / "before")
    flags = ["--file-locks", "--ext-unix-sk", "--link-remap"]
    dump = subprocess.run(
        [str(criu_bin), "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log", *flags],
        capture_output=True,
        text=True,
    )
    assert dump.returncode == 0, (images / "dump.log").read_text()[-2000:]
    proc.wait(timeout=10)  # dump kills the original: what answers next is the restored copy

    restore = subprocess.run(
        [str(criu_bin), "restore", "-D", str(images), "-d", "-o", "restore.log", *flags],
        capture_output=True,
        text=True,
    )
    assert restore.returncode == 0, (images / "restore.log").read_text()[-2000:]
    (work / "go").write_text(uuid.uuid4().hex)
    after_digest, after_pid = wait_file(work / "after").split()
    assert after_digest == before
    assert int(after_pid) == proc.pid
