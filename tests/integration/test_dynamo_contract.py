"""Dynamo 1.6's pod contract, against NVIDIA Dynamo's own code (the ai-dynamo 1.6.1 wheels from PyPI).

The worker of a DGD in Auto mode on the real kubelet node is Dynamo's mocker engine driven by Dynamo's
snapshot lifecycle (`examples/reference_worker/dynamo_mocker_worker.py`: `dynamo.common.snapshot` does
every step), discovering through Dynamo's file backend; Dynamo's frontend runs on the host. Our agent
checkpoints the worker the Job runs when it writes `ready-for-snapshot`, tells it `snapshot-complete`
(it exits 0), then restores two replicas into restore pods whose Dynamo entrypoint stands by
(`maybe_run_restore_standby_mode`: restore-context.json, then `sleep infinity`). Each restored worker
applies restore-context.json, registers, and the frontend answers `/v1/completions` through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.watcher import workload_key
from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import EVENT, POD, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import CHECKPOINT
from dynamo_snapshot_dev.demo.scenario import worker_graph
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import NO_IO_URING_PROFILE, REAL_NODE_TAINT, RealNode
from tests.helpers.dynamo import MOCKER_WORKER, dynamo_env, dynamo_site, pod_worker_env, write_tiny_model
from tests.helpers.kubelet_stack import Stack, eventually, pods

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

GRAPH, SERVICE, MODEL = "dyn", "MockerWorker", "tiny-mocker"
SYSTEM_PORT = 9090
_WORKER_ID = re.compile(r'dynamo_endpoint="generate"[^}]*worker_id="([0-9a-f]*)"')
EXAMPLES = MOCKER_WORKER.parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def frontend(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Dynamo's frontend on the host, discovering workers through the file backend in `kv`."""
    site = dynamo_site()
    kv = tmp_path / "kv"
    kv.mkdir()
    port = _free_port()
    log = (tmp_path / "frontend.log").open("w")
    env = dynamo_env(site, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(kv), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.frontend", "--http-port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}", kv
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()
        log.close()


def _worker_spec(node: RealNode, site: Path, model: Path, kv: Path) -> Obj:
    """Dynamo's worker in a pod of the worker image: Dynamo's packages, the model and the discovery
    directory from the host at the same paths; the chart's io_uring-blocking seccomp profile."""
    mounts = {"dynamo-site": site, "model": model, "kv": kv, "examples": EXAMPLES}
    env = pod_worker_env(site, kv, SYSTEM_PORT)
    return {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        "dnsPolicy": "Default",
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": NO_IO_URING_PROFILE}},
        "volumes": [{"name": name, "hostPath": {"path": str(path)}} for name, path in mounts.items()],
        "mainContainer": {
            "image": node.worker_image.name,
            "imagePullPolicy": "Never",
            "command": ["/usr/bin/python3.11", str(MOCKER_WORKER)],
            "args": ["--model-path", str(model), "--model-name", MODEL],
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "volumeMounts": [
                {"name": name, "mountPath": str(path), "readOnly": name != "kv"}
                for name, path in mounts.items()
            ],
        },
    }


def _registered(kv: Path) -> list[str]:
    """The addresses of the workers registered for the generate endpoint (Dynamo's file discovery)."""
    return sorted(ip for ip, _ in _registrations(kv))


def _registrations(kv: Path) -> list[tuple[str, str]]:
    """(address, worker_id) of each registration of the generate endpoint; the worker_id as Dynamo's
    metrics label it (the instance_id in hex, also the path of its transport address)."""
    found = []
    for entry in (kv / "v1" / "instances").glob("*"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            doc = json.loads(entry.read_text())
            if doc.get("endpoint") != "generate":
                continue
            address, _, path = str(doc["transport"]["tcp"]).partition("/")
            worker_id = format(int(doc["instance_id"]), "x")
            assert path.split("/")[0] == worker_id, doc
            found.append((address.split(":")[0], worker_id))
    return found


def _metrics_worker_ids(ip: str) -> set[str]:
    """The worker_id labels of the generate endpoint's series in the metrics of the worker at ``ip``."""
    with urllib.request.urlopen(f"http://{ip}:{SYSTEM_PORT}/metrics", timeout=5) as resp:
        return set(_WORKER_ID.findall(resp.read().decode()))


def _complete(url: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": "the worker", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


async def test_dynamo_workers_checkpoint_and_restore_through_dynamos_own_lifecycle(
    stack: Stack, cluster: LocalCluster, real_node: RealNode, frontend: tuple[str, Path], tmp_path: Path
) -> None:
    s = stack
    url, kv = frontend
    site = dynamo_site()
    model = write_tiny_model(tmp_path / "model", MODEL)
    s.start_agent()
    spec = _worker_spec(real_node, site, model, kv)
    graph = worker_graph(GRAPH, SERVICE, spec)
    graph["spec"]["services"][SERVICE]["checkpoint"]["identity"] = {
        "model": MODEL,
        "backendFramework": "vllm",
    }
    await DgdClient(s.kube).create({**graph, "metadata": {"name": GRAPH, "namespace": s.namespace}})

    # The checkpoint source ends with 0 once told snapshot-complete, before its SnapshotJob removes it.
    exits: dict[str, int] = {}

    async def watch_sources() -> None:
        while True:
            listed, _ = await s.kube.list_all(POD, s.namespace)
            for p in listed:
                labels = p["metadata"].get("labels") or {}
                if not labels.get(protocol.LABEL_SNAPSHOT_JOB):  # the SnapshotJob's source pod
                    continue
                for st in (p.get("status") or {}).get("containerStatuses") or []:
                    done = (st.get("state") or {}).get("terminated")
                    if done is not None:
                        exits[p["metadata"]["name"]] = int(done.get("exitCode", -1))
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch_sources())
    try:

        async def checkpoint_ready() -> Obj | None:
            items, _ = await s.kube.list_all(CHECKPOINT, s.namespace)
            for ckpt in items:
                phase = (ckpt.get("status") or {}).get("phase")
                if phase == "Failed":
                    listed, _ = await s.kube.list_all(POD, s.namespace)
                    logs = "".join(
                        cluster.kubectl("logs", "-n", s.namespace, p["metadata"]["name"], check=False).stdout[
                            -3000:
                        ]
                        for p in listed
                    )
                    raise AssertionError(f"{ckpt['status']}\n{logs}")
                if phase == "Ready":
                    return ckpt
            return None

        ckpt = await eventually(checkpoint_ready, 240, "the Auto-mode checkpoint of the Dynamo worker")

        async def exited() -> dict[str, int]:
            return exits

        await eventually(exited, 30, "the checkpoint source to exit")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert list(exits.values()) == [0], exits
    assert ckpt["status"]["sourcePod"] in exits

    # The cold worker registered and serves through the frontend.
    async def cold_registered() -> list[str]:
        return _registered(kv)

    await eventually(cold_registered, 120, "the cold worker to register")
    answer = await asyncio.to_thread(_complete, url)
    assert answer["usage"]["completion_tokens"] == 4

    # Two restored replicas.
    await DgdClient(s.kube).set_replicas(GRAPH, s.namespace, SERVICE, 3)

    async def restored() -> list[Obj]:
        found = await pods(s, protocol.StartMode.RESTORE.value)
        statuses = [
            (p["metadata"].get("annotations") or {}).get(
                protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
            )
            for p in found
        ]
        assert "failed" not in statuses, [p["metadata"].get("annotations") for p in found]
        return found if statuses.count("completed") == 2 else []

    restore_pods = await eventually(restored, 180, "2 restores of the Dynamo worker")
    ips = sorted(p["status"]["podIP"] for p in restore_pods)
    cold_ip = (await pods(s, protocol.StartMode.COLD.value))[0]["status"]["podIP"]

    async def all_registered() -> list[str]:
        now = _registered(kv)
        return now if set(ips) <= set(now) else []

    registered = await eventually(all_registered, 120, "the restored workers to register")
    assert sorted(registered) == sorted([cold_ip, *ips])
    # Each worker reports itself, not the checkpoint's source: one registration per pod, each with a
    # worker_id of its own, the same one its metrics are labelled with (a restored worker that kept its
    # source's identity, or lost it, would freeze Dynamo's planner).
    ids = dict(_registrations(kv))
    assert len(set(ids.values())) == 3, ids
    assert all(ids.values()), ids
    for ip, worker_id in ids.items():
        labelled = await asyncio.to_thread(_metrics_worker_ids, ip)
        assert labelled == {worker_id}, (ip, worker_id, labelled)
    for pod in restore_pods:
        # Dynamo's standby wrote the restore context; the restored worker read it (its own pod's name).
        assert s.runtime is not None
        ctl = s.runtime.control_dir(workload_key(pod))
        context = json.loads((ctl / protocol.FILE_RESTORE_CONTEXT).read_text())
        assert context["env"]["DYN_DISCOVERY_BACKEND"] == "file"
        logs = cluster.kubectl("logs", "-n", s.namespace, pod["metadata"]["name"]).stdout
        assert "Applied snapshot restore context runtime env" in logs, logs[-3000:]
    for _ in range(6):
        answer = await asyncio.to_thread(_complete, url)
        assert answer["usage"]["completion_tokens"] == 4

    # With the cold worker gone (its pod deleted: it leaves discovery), the restored ones answer alone.
    cold = (await pods(s, protocol.StartMode.COLD.value))[0]
    cluster.kubectl(
        "delete",
        "-n",
        s.namespace,
        "pod",
        cold["metadata"]["name"],
        "--wait=true",
        "--timeout=60s",
        timeout=70,
    )

    async def cold_gone() -> list[str]:
        now = _registered(kv)
        return now if cold_ip not in now else []

    await eventually(cold_gone, 60, "the cold worker to leave Dynamo's discovery")
    for _ in range(6):
        answer = await asyncio.to_thread(_complete, url)
        assert answer["usage"]["completion_tokens"] == 4


async def test_a_worker_that_never_says_ready_fails_its_checkpoint_with_a_clear_message(
    stack: Stack, real_node: RealNode, tmp_path: Path
) -> None:
    """A worker that is not snapshot-aware never writes ready-for-snapshot: its source pod never becomes
    ready (the SnapshotJob's probe reads that file), and at the checkpoint's deadline the checkpoint fails
    saying so, on the DynamoCheckpoint's status and in a Warning Event."""
    s = stack
    s.start_agent()
    spec = _worker_spec(real_node, dynamo_site(), write_tiny_model(tmp_path / "model", MODEL), tmp_path)
    main = {**spec.pop("mainContainer"), "name": "main", "command": ["sleep", "3600"], "args": []}
    checkpoint = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "silent", "namespace": s.namespace},
        "spec": {
            "identity": {"model": MODEL, "backendFramework": "vllm"},
            "job": {
                "activeDeadlineSeconds": 20,
                "podTemplateSpec": {"spec": {**spec, "restartPolicy": "Never", "containers": [main]}},
            },
        },
    }
    await s.kube.create(CHECKPOINT, checkpoint)

    async def failed() -> Obj | None:
        ckpt: Obj = await s.kube.get(CHECKPOINT, "silent", s.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == "Failed" else None

    ckpt = await eventually(failed, 120, "the checkpoint to fail")
    expected = f"its pod never became ready: the worker wrote no {protocol.FILE_READY_FOR_SNAPSHOT}"
    message = ckpt["status"]["message"]
    assert "DeadlineExceeded" in message
    assert expected in message
    events, _ = await s.kube.list_all(EVENT, s.namespace)
    warnings = [
        e
        for e in events
        if e.get("reason") == "CheckpointFailed" and e["involvedObject"]["kind"] == "DynamoCheckpoint"
    ]
    assert warnings, [e.get("reason") for e in events]
    assert expected in warnings[0]["message"]
