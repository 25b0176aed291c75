"""The real node: pods from the local test image run under the kubelet + containerd + runc, on a CNI bridge.

Everything is real: kubelet and kube-proxy v1.37, containerd 2.2, runc, the CNI bridge plugin. The last test
stops the node and starts it again, so it runs last in this file.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import IP_FORWARD, RUNC, RUNC_ROOT, TEST_IMAGE, RealNode
from tests.helpers.polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

HTTP_PORT = 8080


def _httpd_pod(node: RealNode, name: str, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            **node.pod_overrides(),
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "web",
                    "image": TEST_IMAGE.name,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", f"echo web-started; exec httpd -f -p {HTTP_PORT} -h /www"],
                    "readinessProbe": {"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 1},
                }
            ],
        },
    }


def _run_pod(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    cluster.apply(manifest, namespace=namespace)
    name = manifest["metadata"]["name"]
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}", "--timeout=90s", timeout=100
    )
    pod: dict[str, Any] = json.loads(
        cluster.kubectl("get", "-n", namespace, "pod", name, "-o", "json").stdout
    )
    return pod


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _container_id(pod: dict[str, Any]) -> str:
    cid = str(pod["status"]["containerStatuses"][0]["containerID"])
    runtime, _, ident = cid.partition("://")
    assert runtime == "containerd", cid
    return ident


def _runc_state(container_id: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(RUNC), "--root", str(RUNC_ROOT), "state", container_id],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    state: dict[str, Any] = json.loads(proc.stdout)
    return state


def _pids_in_pod_cgroup(pod_uid: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cgroups = Path(f"/proc/{entry.name}/cgroup").read_text()
        except OSError:
            continue
        if f"pod{pod_uid}" in cgroups:
            found.append(int(entry.name))
    return found


def test_pod_runs_and_answers_on_its_pod_ip(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    pod = _run_pod(cluster, namespace, _httpd_pod(real_node, "web"))
    assert pod["spec"]["nodeName"] == real_node.name
    ip = pod["status"]["podIP"]
    assert ip.startswith(real_node.node_ip.rsplit(".", 1)[0] + "."), ip
    assert _get(f"http://{ip}:{HTTP_PORT}/") == "ok\n"

    # logs and exec go apiserver -> kubelet (client cert, InternalIP) -> containerd streaming.
    logs = cluster.kubectl("logs", "-n", namespace, "web").stdout
    assert "web-started" in logs
    out = cluster.kubectl("exec", "-n", namespace, "web", "--", "cat", "/www/index.html").stdout
    assert out == "ok\n"
    hostname = cluster.kubectl("exec", "-n", namespace, "web", "--", "hostname").stdout.strip()
    assert hostname == "web"


def test_cluster_ip_service_reaches_the_pod(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    assert real_node.alive().get("kube-proxy"), "kube-proxy is not running on the real node"
    app = f"web-{uuid.uuid4().hex[:6]}"
    _run_pod(cluster, namespace, _httpd_pod(real_node, "svc-web", labels={"app": app}))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": app}, "ports": [{"port": 80, "targetPort": HTTP_PORT}]},
    }
    cluster.apply(service, namespace=namespace)
    svc = json.loads(cluster.kubectl("get", "-n", namespace, "service", "web", "-o", "json").stdout)
    cluster_ip = svc["spec"]["clusterIP"]

    def answers() -> str:
        try:
            return _get(f"http://{cluster_ip}:80/")
        except OSError:
            return ""

    assert wait_for(answers, within=30, what=f"service {cluster_ip}:80 to answer") == "ok\n"


def test_runc_state_is_found_from_the_container_id(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    pod = _run_pod(cluster, namespace, _httpd_pod(real_node, "state"))
    cid = _container_id(pod)
    assert (RUNC_ROOT / cid / "state.json").is_file()
    state = _runc_state(cid)
    assert state["status"] == "running"
    annotations = state["annotations"]
    assert annotations["io.kubernetes.cri.container-type"] == "container"
    assert annotations["io.kubernetes.cri.container-name"] == "web"
    assert annotations["io.kubernetes.cri.sandbox-name"] == "state"
    assert annotations["io.kubernetes.cri.sandbox-namespace"] == namespace
    pid = int(state["pid"])
    assert "httpd" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert f"pod{pod['metadata']['uid']}/{cid}" in Path(f"/proc/{pid}/cgroup").read_text()


def test_deleting_the_pod_leaves_no_process(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    pod = _run_pod(cluster, namespace, _httpd_pod(real_node, "gone"))
    uid = pod["metadata"]["uid"]
    pid = int(_runc_state(_container_id(pod))["pid"])
    assert pid in _pids_in_pod_cgroup(uid)
    cluster.kubectl("delete", "-n", namespace, "pod", "gone", "--wait=true", "--timeout=60s", timeout=70)
    wait_for(lambda: not _pids_in_pod_cgroup(uid), within=30, what=f"no process left in pod {uid}'s cgroup")
    assert not Path(f"/proc/{pid}").exists() or "httpd" not in Path(f"/proc/{pid}/cmdline").read_text()


def test_kubelet_checkpoint_api_dumps_the_container(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    """containerd 2.x + the patched CRIU on its PATH: the kubelet's checkpoint call dumps a container
    with a listening inet socket (busybox httpd), which stock CRIU 4.1.1 cannot on this kernel."""
    _run_pod(cluster, namespace, _httpd_pod(real_node, "ckpt"))
    ctx = ssl.create_default_context(cafile=str(real_node.pki.ca_cert))
    ctx.load_cert_chain(str(real_node.pki.admin_cert), str(real_node.pki.admin_key))
    url = f"https://{real_node.node_ip}:{real_node.options.kubelet_port}/checkpoint/{namespace}/ckpt/web"
    request = urllib.request.Request(url, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60, context=ctx) as resp:
            items = json.loads(resp.read())["items"]
    except urllib.error.HTTPError as e:
        pytest.fail(
            f"kubelet checkpoint: HTTP {e.code}: {e.read().decode()}\n{real_node.log_tail('containerd')}"
        )
    (archive,) = items
    path = Path(archive)
    assert path.is_relative_to(real_node.kubelet_root / "checkpoints")
    with tarfile.open(path) as tar:
        names = tar.getnames()
    assert any(n.startswith("checkpoint/") for n in names), names
    # --leave-running: the pod keeps serving.
    pod = json.loads(cluster.kubectl("get", "-n", namespace, "pod", "ckpt", "-o", "json").stdout)
    assert _get(f"http://{pod['status']['podIP']}:{HTTP_PORT}/") == "ok\n"


KILLED_RUN = """
import json, sys, time
from pathlib import Path
from dynamo_snapshot_dev.localcluster.pki import make_pki
from dynamo_snapshot_dev.localcluster.realnode import RealNode
server, pki_dir, kubeconfig, kubectl, workdir, namespace, manifest = sys.argv[1:]
node = RealNode(Path(workdir), server=server, pki=make_pki(Path(pki_dir), []),
                admin_kubeconfig=Path(kubeconfig), kubectl=Path(kubectl))
node.start()
node.kubectl("apply", "-n", namespace, "-f", manifest)
node.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/orphan", "--timeout=60s", timeout=70)
print("READY", flush=True)
time.sleep(600)
"""


def test_start_cleans_up_after_a_killed_run(
    cluster: LocalCluster, real_node: RealNode, namespace: str, tmp_path: Path
) -> None:
    """A run killed with SIGKILL leaves its pod's processes, shim, mounts, cgroups and bridge; the next
    start removes them before it starts its own."""
    cluster.stop_real_node()
    manifest = tmp_path / "orphan.json"
    # Not restarted by the next kubelet: the pod object is gone before it starts.
    manifest.write_text(json.dumps(_httpd_pod(real_node, "orphan")))
    workdir = tmp_path / "killed-node"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, cluster.server, str(cluster.workdir / "pki"),
         str(cluster.kubeconfig), str(cluster.components.kubectl), str(workdir), namespace, str(manifest)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != "READY":
            child.kill()
            pytest.fail(f"the node run to be killed did not start: {line}{child.stdout.read()}")
        pod = json.loads(cluster.kubectl("get", "-n", namespace, "pod", "orphan", "-o", "json").stdout)
    finally:
        child.kill()
        child.wait()
    orphan_id = _container_id(pod)
    orphan_pid = int(_runc_state(orphan_id)["pid"])
    assert Path(f"/proc/{orphan_pid}").exists(), "the killed run's container should outlive it"
    assert any(str(workdir) in m for m in Path("/proc/self/mountinfo").read_text().splitlines())
    cluster.kubectl("delete", "-n", namespace, "pod", "orphan", "--grace-period=0", "--force", check=False)

    cluster.start_real_node()
    assert not Path(f"/proc/{orphan_pid}").exists()
    assert not (RUNC_ROOT / orphan_id).exists()
    assert not _pids_in_pod_cgroup(pod["metadata"]["uid"])
    assert not any(str(workdir) in m for m in Path("/proc/self/mountinfo").read_text().splitlines())
    web = _run_pod(cluster, namespace, _httpd_pod(real_node, "after-kill"))
    assert _get(f"http://{web['status']['podIP']}:{HTTP_PORT}/") == "ok\n"


def test_node_stops_cleanly_and_starts_again(
    cluster: LocalCluster, real_node: RealNode, namespace: str
) -> None:
    _run_pod(cluster, namespace, _httpd_pod(real_node, "before-stop"))
    cluster.stop_real_node()
    assert real_node.leftovers() == []
    nodes = cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert f"node/{real_node.name}" not in nodes
    forwarding = IP_FORWARD.read_text()

    again = cluster.start_real_node()
    assert again is real_node
    pod = _run_pod(cluster, namespace, _httpd_pod(real_node, "after-start"))
    assert _get(f"http://{pod['status']['podIP']}:{HTTP_PORT}/") == "ok\n"
    # The bridge plugin turns forwarding on for its gateway; a stop puts back the host's setting.
    assert IP_FORWARD.read_text().strip() == "1"
    cluster.stop_real_node()
    assert IP_FORWARD.read_text() == forwarding
    assert real_node.leftovers() == []
    cluster.start_real_node()
