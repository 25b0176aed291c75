"""NVIDIA's snapshot agent (ai-dynamo/snapshot) on the real kubelet node, for vs_nvidia_snapshot.py: its
image, their chart's rendering (render_chart) with the agent's RBAC and config, the source, agent and restore
pods of their contract, the agent's start, and the restores (one at a time, each timed create ->
``GET /health`` 200 on the pod IP). The facts behind each adaptation are in vs_nvidia_snapshot.py's
docstring; the operator's part is nvidia_operator.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.cluster import ClusterOptions
from dynamo_snapshot_dev.localcluster.images import (
    WORKER_ENTRYPOINT,
    Entry,
    ImageRef,
    build_worker_rootfs,
    busybox_entries,
    file_entry,
    materialize,
    shared_libraries,
    write_oci_archive,
)
from dynamo_snapshot_dev.localcluster.images import WORKER_ENV as WORKER_IMAGE_ENV
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from tests.helpers.kubelet_stack import PORT
from tests.helpers.polling import wait_for

NS = "nv-snapshot"  # agent, source and restore pods
RELEASE = "snap"
AGENT_BINS = ("agent", "nsrestore", "ns-bind-mount")
HOST_TOOLS = {"nsenter": Path("/usr/bin/nsenter"), "tar": Path("/usr/bin/tar"), "ip": Path("/usr/sbin/ip")}
# CRIU's dump locks the pod's network with iptables-restore (their image installs iptables): the host's
# nft-backed multi-call binary, its libraries and match modules.
XTABLES = Path("/usr/sbin/xtables-nft-multi")
XTABLES_MODULES = Path("/usr/lib/x86_64-linux-gnu/xtables")
XTABLES_NAMES = (
    "iptables",
    "iptables-restore",
    "iptables-save",
    "ip6tables",
    "ip6tables-restore",
    "ip6tables-save",
)
# libc's family stays the placeholder's own, as their Dockerfile excludes it from the bundle's lib/.
BUNDLE_LIB_EXCLUDE = (
    "ld-linux", "libc.", "libm.", "libmvec", "libdl.", "libpthread", "librt.", "libresolv", "libutil.",
    "libanl", "libnsl", "libthread_db",
)  # fmt: skip
# Their chart's CRIU settings that stock CRIU 4.1.1 needs: allow-uprobes is unknown to it (the dump fails
# with err:56), the RPC's image_io_mode is ignored by it, and the inet-remap plugin cannot be built for it.
CRIU_VALUES = {
    "allowUprobes": False,
    "imageIoMode": "writeback",
    "tcpEstablished": False,
    "tcpClose": True,
    "libDir": "",
    "binaryPath": "/usr/local/sbin/criu",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Peer:
    source: Path  # a checkout of ai-dynamo/snapshot (their chart and CRDs)
    bin: Path  # agent, nsrestore, ns-bind-mount (scripts/nvidia-snapshot-peer.sh)
    criu: Path
    helm: Path

    def missing(self) -> str | None:
        """One line naming what is missing, or None."""
        if not (self.source / "charts/snapshot/crds").is_dir():
            return (
                f"--nv-source {self.source}: no charts/snapshot/crds (not a checkout of ai-dynamo/snapshot)"
            )
        absent = [str(self.bin / b) for b in AGENT_BINS if not (self.bin / b).is_file()]
        if absent:
            return (
                f"--nv-bin {self.bin}: missing {', '.join(absent)} (run scripts/nvidia-snapshot-peer.sh DIR)"
            )
        tools = [self.criu, self.helm, XTABLES, *HOST_TOOLS.values()]
        absent = [str(p) for p in tools if not p.exists()]
        return f"missing host tools: {', '.join(absent)}" if absent else None

    def commit(self) -> str:
        stamp = self.bin / ".built-commit"
        return stamp.read_text().strip() if stamp.is_file() else "unknown (no .built-commit stamp)"


@dataclass(frozen=True)
class Workload:
    """A worker both agents checkpoint and restore: one image, one environment, no memory limit; ``main``
    (command, args, volumeMounts of the container), ``volumes`` and ``spec`` (pod fields) where it needs
    more than its image. It serves once ``GET /health`` on ``port`` answers 200."""

    name: str
    image: ImageRef
    archive: Path
    env: dict[str, str]
    port: int = PORT
    main: dict[str, Any] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)
    prompt: bytes | None = b"hello"  # POST /generate answers it (the CPU reference worker)

    @property
    def ckpt_id(self) -> str:
        return f"{self.name}-ckpt"

    @property
    def source(self) -> str:
        return f"{self.name}-source"


def workload_image(out_dir: Path) -> tuple[ImageRef, Path]:
    """The CPU reference worker's image (node.worker_image's files, entrypoint and env) plus an empty /run and
    /bin/gzip (busybox): CRIU 4.1.1's restore mounts a tmpfs on /run for the xtables lock, and it unpacks the
    container's /dev tmpfs with `tar --gzip` run in the placeholder (their bundle has tar, no gzip)."""
    rootfs = out_dir / "worker-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    base = build_worker_rootfs(rootfs)
    (rootfs / "run").mkdir(mode=0o755)
    (rootfs / "bin/gzip").symlink_to("busybox")
    image = ImageRef("localhost/vs-nvidia/worker", base.tag + "-run")
    archive = write_oci_archive(
        out_dir / "worker-run.tar",
        rootfs,
        image,
        entrypoint=WORKER_ENTRYPOINT,
        env=WORKER_IMAGE_ENV,
        compresslevel=1,
    )
    shutil.rmtree(rootfs, ignore_errors=True)
    return image, archive


def agent_image(peer: Peer, out_dir: Path) -> tuple[ImageRef, Path]:
    """Their agent, ns-bind-mount, CRIU at /usr/local/sbin/criu, tar, nsenter, ip, iptables, busybox, and the
    restore bundle /snapshot-binaries/{nsrestore,criu,tar,ip,lib/,criu-plugins/} (nsmount/injector.go)."""
    bins = {name: peer.bin / name for name in AGENT_BINS}
    tools = HOST_TOOLS
    entries: list[Entry] = [*busybox_entries(), Entry("bin/gzip", link="busybox")]
    entries += [
        Entry("usr/local/bin/snapshot-agent", src=bins["agent"], mode=0o755),
        Entry("usr/local/sbin/ns-bind-mount", src=bins["ns-bind-mount"], mode=0o755),
        Entry("usr/local/sbin/criu", src=peer.criu, mode=0o755),
        *(Entry(str(p).lstrip("/"), src=p, mode=0o755) for p in tools.values()),
        Entry("snapshot-binaries/nsrestore", src=bins["nsrestore"], mode=0o755),
        Entry("snapshot-binaries/criu", src=peer.criu, mode=0o755),
        Entry("snapshot-binaries/tar", src=tools["tar"], mode=0o755),
        Entry("snapshot-binaries/ip", src=tools["ip"], mode=0o755),
        *(Entry(d, mode=0o755, is_dir=True) for d in ("snapshot-binaries/criu-plugins", "checkpoints")),
        *(Entry(d, mode=0o755, is_dir=True) for d in ("var/criu-work", "etc/snapshot", "host/proc")),
        Entry("usr/sbin/xtables-nft-multi", src=XTABLES, mode=0o755),
        *(Entry(f"usr/sbin/{n}", link="xtables-nft-multi") for n in XTABLES_NAMES),
        *(file_entry(str(m).lstrip("/"), m) for m in sorted(XTABLES_MODULES.glob("*.so"))),
    ]
    libs = shared_libraries([peer.criu, bins["ns-bind-mount"], XTABLES, *tools.values()])
    entries += [file_entry(lib.lstrip("/"), Path(lib)) for lib in sorted(libs)]
    bundle_libs = shared_libraries([peer.criu, tools["tar"], tools["ip"]])
    entries += [
        file_entry(f"snapshot-binaries/lib/{Path(lib).name}", Path(lib))
        for lib in sorted(bundle_libs)
        if not Path(lib).name.startswith(BUNDLE_LIB_EXCLUDE)
    ]
    rootfs = out_dir / "agent-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    materialize(rootfs, entries)
    image = ImageRef("localhost/vs-nvidia/snapshot-agent", str(int(time.time())))
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    archive = write_oci_archive(
        out_dir / "agent.tar",
        rootfs,
        image,
        entrypoint=["/usr/local/bin/snapshot-agent"],
        env=env,
        compresslevel=1,
    )
    shutil.rmtree(rootfs, ignore_errors=True)
    return image, archive


def render_chart(peer: Peer, workdir: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Their chart rendered by `helm template` with CRIU_VALUES and ``values`` (merged over them)."""
    path = workdir / "values.yaml"
    path.write_text(yaml.safe_dump({"config": {"criu": CRIU_VALUES}, **values}))
    chart = str(peer.source / "charts/snapshot")
    argv = [str(peer.helm), "template", RELEASE, chart, "-n", NS, "-f", str(path)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def chart_objects(peer: Peer, workdir: Path) -> list[dict[str, Any]]:
    """The agent's ServiceAccount, ClusterRoles/Bindings and ConfigMap of their chart (the DaemonSet is
    replaced by agent_pod, the PVC by a hostPath)."""
    keep = {
        ("ServiceAccount", f"{RELEASE}-snapshot"),
        ("ConfigMap", f"{RELEASE}-snapshot-config"),
        ("ClusterRole", f"{RELEASE}-snapshot-agent"),
        ("ClusterRole", f"{RELEASE}-snapshot-agent-podsnapshotcontents"),
        ("ClusterRoleBinding", f"{RELEASE}-snapshot-agent"),
        ("ClusterRoleBinding", f"{RELEASE}-snapshot-agent-podsnapshotcontents"),
    }
    objs = render_chart(peer, workdir, {})
    return [o for o in objs if (o["kind"], o["metadata"]["name"]) in keep]


def worker_pod(node: RealNode, name: str, work: Workload, *, restore: bool) -> dict[str, Any]:
    """The source pod (their checkpoint-source labels, readiness on ready-for-snapshot) or a restore pod
    (operator/internal/protocol/restore.go NewRestorePod: restore-target labels, target-containers and
    artifact-version annotations, standby env, startup probe on restore-complete)."""
    env = [{"name": k, "value": v} for k, v in work.env.items()]
    env += [
        {"name": n, "value": "/snapshot-control"}
        for n in ("SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")
    ]
    if restore:
        env += [
            {"name": n, "value": "1"} for n in ("DYN_SNAPSHOT_RESTORE_STANDBY", "SNAPSHOT_RESTORE_STANDBY")
        ]
    probe = {"periodSeconds": 1, "timeoutSeconds": 1}
    container: dict[str, Any] = {
        "name": "main",
        "image": work.image.name,
        "imagePullPolicy": "Never",
        **work.main,
        "env": env,
        "volumeMounts": [
            {"name": "snapshot-control", "mountPath": "/snapshot-control", "subPath": "main"},
            *work.main.get("volumeMounts", []),
        ],
    }
    labels = {"nvidia.com/snapshot-checkpoint-id": work.ckpt_id}
    if restore:
        command = ["cat", "/snapshot-control/restore-complete"]
        container["startupProbe"] = {"exec": {"command": command}, "failureThreshold": 1800, **probe}
        labels["nvidia.com/snapshot-is-restore-target"] = "true"
    else:
        container["readinessProbe"] = {
            "exec": {"command": ["cat", "/snapshot-control/ready-for-snapshot"]},
            **probe,
        }
        labels["nvidia.com/snapshot-is-checkpoint-source"] = "true"
    volumes = [{"name": "snapshot-control", "emptyDir": {}}, *work.volumes]
    pod = node.pod(name, [container], volumes=volumes, restartPolicy="Never", **work.spec)
    annotations = {
        "nvidia.com/snapshot-target-containers": "main",
        "nvidia.com/snapshot-artifact-version": "1",
    }
    pod["metadata"].update(namespace=NS, labels=labels, annotations=annotations)
    return pod


def agent_pod(node: RealNode, image: str, api_port: int, checkpoints: Path) -> dict[str, Any]:
    """Their daemonset.yaml's pod, adapted: no runtimeClassName / GPU selector / init container; the node's
    containerd socket dir and root; a hostPath for /checkpoints; the apiserver at 127.0.0.1 (host network);
    /sys/fs/cgroup = the host's v1 freezer hierarchy (the agent asks CRIU to freeze /sys/fs/cgroup/<the `0::`
    path>, which on this v1 + v2 hybrid host then is the container's freezer cgroup)."""
    root, sock_dir = str(node.workdir / "containerd"), str(node.containerd_socket.parent)
    pods = str(node.kubelet_root / "pods")
    mounts = [
        ("config", "/etc/snapshot", None, True),
        ("checkpoints", "/checkpoints", {"path": str(checkpoints), "type": "DirectoryOrCreate"}, False),
        ("runtime-run", sock_dir, {"path": sock_dir, "type": "Directory"}, False),
        ("runtime-storage", root, {"path": root, "type": "Directory"}, True),
        ("host-proc", "/host/proc", {"path": "/proc", "type": "Directory"}, False),
        ("host-cgroup", "/sys/fs/cgroup", {"path": "/sys/fs/cgroup/freezer", "type": "Directory"}, False),
        ("kubelet-pods", "/var/lib/kubelet/pods", {"path": pods, "type": "Directory"}, True),
    ]
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": f"{RELEASE}-snapshot-config"}}]
    volumes += [{"name": n, "hostPath": hp} for n, _, hp, _ in mounts if hp is not None]
    container = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": "Never",
        "args": ["--runtime", "containerd", "--runtime-socket", str(node.containerd_socket)],
        "securityContext": {"privileged": True},
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "SNAPSHOT_LOG_LEVEL", "value": "info"},
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
        ],
        "volumeMounts": [{"name": n, "mountPath": p, "readOnly": ro} for n, p, _, ro in mounts],
    }
    spec = {
        "serviceAccountName": f"{RELEASE}-snapshot",
        "hostPID": True,
        "hostIPC": True,
        "hostNetwork": True,
    }
    pod = node.pod("nv-snapshot-agent", [container], volumes=volumes, **spec)
    pod["metadata"].update(namespace=NS, labels={"app.kubernetes.io/component": "snapshot-agent"})
    return pod


class Api:
    """Direct HTTPS to the apiserver with the admin cert (a kubectl process costs ~0.1 s in a timed loop)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        kc = json.loads(cluster.kubeconfig.read_text())
        self.server = kc["clusters"][0]["cluster"]["server"]
        user = kc["users"][0]["user"]
        self.ssl = ssl.create_default_context(cafile=kc["clusters"][0]["cluster"]["certificate-authority"])
        self.ssl.load_cert_chain(user["client-certificate"], user["client-key"])

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise RuntimeError(f"{method} {path}: {e.code} {e.read()[:500]!r}") from None

    def pod(self, name: str) -> Any:
        return self.call("GET", f"/api/v1/namespaces/{NS}/pods/{name}")

    def create(self, obj: dict[str, Any]) -> None:
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(obj))

    def get(self, *args: str) -> Any:
        proc = self.cluster.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout else None

    def delete_pod(self, name: str, timeout: float = 60) -> None:
        self.call("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", {"gracePeriodSeconds": 1})
        wait(f"pod {name} gone", lambda: self.pod(name) is None, timeout, 0.1)


def cond(obj: Any, kind: str) -> bool:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conds)


def wait(what: str, fn: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """``fn()``'s first truthy answer, polled; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    try:
        return wait_for(fn, timeout, what, interval)
    except AssertionError as e:
        raise TimeoutError(str(e)) from None


def get_json(ip: str, path: str, body: bytes | None = None, port: int = PORT) -> Any:
    req = urllib.request.Request(f"http://{ip}:{port}{path}", data=body, method="POST" if body else "GET")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def serving(ip: str, port: int) -> bool:
    """Whether the worker at ``ip`` answers ``GET /health`` on ``port`` with 200 (within a second)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=1) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def host_pid(argv0: bytes) -> int | None:
    """The host PID of the process whose argv[0] is ``argv0``."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().split(b"\0")[0] == argv0:
                    return int(p.name)
            except OSError:
                continue
    return None


def cpu_seconds(pid: int) -> dict[str, float]:
    """utime+stime of the agent, and of its waited-for children (criu via go-criu swrk, nsenter/nsrestore)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    ut, st, cut, cst = (int(fields[i]) / tick for i in (11, 12, 13, 14))
    return {"self": round(ut + st, 2), "children": round(cut + cst, 2)}


def du_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def go_seconds(text: str) -> float:
    """A Go time.Duration's String() ("1m2.5s", "216.28596ms", "22.146µs", "0s") in seconds."""
    parts = re.findall(r"([0-9.]+)(h|ms|us|µs|ns|m|s)", text)
    return round(sum(float(n) * GO_UNITS[u] for n, u in parts), 6)


def agent_logs(cluster: LocalCluster, tail: int = 100000) -> str:
    return cluster.kubectl("logs", "-n", NS, "nv-snapshot-agent", f"--tail={tail}", check=False).stdout


def timing_summaries(text: str, what: str) -> list[tuple[float, dict[str, Any]]]:
    """The agent's "<what> timing summary" log lines: (wall time, their JSON fields)."""
    found = []
    for line in text.splitlines():
        if f"{what} timing summary" in line and "{" in line:
            stamp = line.split("\t", 1)[0]
            at = datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp()
            found.append((at, json.loads(line[line.index("{") :])))
    return found


def start_cluster(work: Path) -> LocalCluster:
    """A fresh control plane and the real node (no kwok)."""
    shutil.rmtree(work, ignore_errors=True)
    cluster = LocalCluster(work, options=ClusterOptions(real_node=True, kwok=False))
    cluster.start()
    return cluster


def install(cluster: LocalCluster, peer: Peer, work: Path, archives: list[Path]) -> dict[str, Any]:
    """Their CRDs, namespace, RBAC and agent config; the images imported. The agent config, as applied."""
    node = cluster.real_node
    assert node is not None
    for archive in archives:
        node.ctr("images", "import", str(archive), timeout=300)
    cluster.kubectl("apply", "--server-side", "-f", str(peer.source / "charts/snapshot/crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    cluster.kubectl("create", "namespace", NS)
    api = Api(cluster)
    wait("default SA", lambda: api.get("sa", "-n", NS, "default"), 60)
    for obj in chart_objects(peer, work):
        cluster.apply(obj, namespace=NS if obj["kind"] in ("ServiceAccount", "ConfigMap") else None)
    config: dict[str, Any] = yaml.safe_load(
        api.get("cm", "-n", NS, f"{RELEASE}-snapshot-config")["data"]["config.yaml"]
    )
    return config


def checkpoint(
    cluster: LocalCluster, api: Api, work: Workload, checkpoints: Path, timeout: float
) -> dict[str, Any]:
    """Without their operator (vs_nvidia_snapshot.py --nv-without-operator): the PodSnapshot, and the
    PodSnapshotContent their operator makes of it (podsnapshot_reconciler.go buildPodSnapshotContent), written
    here; waits until the agent sets the content Ready."""
    node = cluster.real_node
    assert node is not None
    ckpt_id = work.ckpt_id
    src = api.pod(work.source)
    podref = {"name": work.source, "containers": ["main"]}
    meta = {"name": ckpt_id, "namespace": NS}
    api.create({"apiVersion": "nvidia.com/v1alpha1", "kind": "PodSnapshot", "metadata": meta,
                "spec": {"source": {"podRef": podref}}})  # fmt: skip
    snap = api.get("podsnapshot", "-n", NS, ckpt_id)
    content = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshotContent",
        "metadata": {"name": f"{ckpt_id}-content", "labels": {"nvidia.com/snapshot-node": node.name}},
        "spec": {
            "snapshotRef": {"namespace": NS, "name": ckpt_id, "uid": snap["metadata"]["uid"]},
            "source": {"podRef": {**podref, "uid": src["metadata"]["uid"]}, "nodeName": node.name},
        },
    }
    t0 = time.monotonic()
    api.create(content)

    def done() -> Any:
        c = api.get("podsnapshotcontent", f"{ckpt_id}-content")
        if cond(c, "Failed"):
            raise RuntimeError(f"checkpoint failed: {json.dumps(c['status'])}\n{agent_logs(cluster, 40)}")
        return c if cond(c, "Ready") else None

    try:
        ready = wait("PodSnapshotContent Ready", done, timeout, 0.1)
    except TimeoutError:
        raise RuntimeError(f"checkpoint timed out\n{agent_logs(cluster, 60)}") from None
    wall = time.monotonic() - t0
    return {
        "path": "PodSnapshot, and a PodSnapshotContent written here -> their agent",
        "content_created_to_ready_s": round(wall, 3),
        "status": ready["status"],
        **captured(cluster, work, checkpoints, f"{ckpt_id}-content"),
    }


def captured(cluster: LocalCluster, work: Workload, checkpoints: Path, content: str) -> dict[str, Any]:
    """The agent's own duration and phases of the checkpoint of PodSnapshotContent ``content`` (its log's
    timing summary) and the artifact's files and bytes (checkpoints/<checkpoint id>/)."""
    summaries = [
        s for _, s in timing_summaries(agent_logs(cluster), "Checkpoint") if s.get("content") == content
    ]
    own = (summaries[-1] if summaries else {}).get("checkpoint") or {}
    root = checkpoints / work.ckpt_id
    return {
        "agent_s": go_seconds(own["duration"]) if "duration" in own else None,
        "agent_phases_s": {k: go_seconds(v) for k, v in (own.get("phases") or {}).items()},
        "artifact_bytes": du_bytes(root),
        "artifact_files": sorted(str(p.relative_to(checkpoints)) for p in root.rglob("*") if p.is_file()),
    }


def restore_one(cluster: LocalCluster, api: Api, work: Workload, name: str, timeout: float) -> dict[str, Any]:
    """One restore pod, timed from the create call to the first GET /health 200 on its IP (10 ms polls)."""
    node = cluster.real_node
    assert node is not None
    pod = worker_pod(node, name, work, restore=True)
    t0_wall, t0 = time.time(), time.monotonic()
    api.call("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    ip = wait("pod IP", lambda: ((api.pod(name) or {}).get("status") or {}).get("podIP"), 60, 0.01)
    next_check = [time.monotonic() + 2]

    def up() -> bool:
        if serving(ip, work.port):
            return True
        if time.monotonic() >= next_check[0]:
            next_check[0] = time.monotonic() + 2
            ann = ((api.pod(name) or {}).get("metadata") or {}).get("annotations") or {}
            if ann.get("nvidia.com/snapshot-restore-status.main") == "failed":
                raise RuntimeError(f"restore failed: {ann}")
        return False

    wait("GET /health", up, timeout, 0.01)
    total = time.monotonic() - t0
    sample = {"pod": name, "total_s": total, "t0_wall": t0_wall,
              "health": get_json(ip, "/health", port=work.port)}  # fmt: skip
    if work.prompt is not None:
        sample["generate"] = get_json(ip, "/generate", work.prompt, port=work.port)
    return sample


def restores(cluster: LocalCluster, api: Api, work: Workload, n: int, timeout: float) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    for i in range(n):
        name = f"{work.name}-restore-{i}"
        try:
            sample = restore_one(cluster, api, work, name, timeout)
            log(f"nvidia {work.name} restore {i}: serving after {sample['total_s']:.3f}s")
        except Exception as e:
            sample = {"pod": name, "error": str(e)[:4000]}
            log(f"nvidia {work.name} restore {i} FAILED: {e}\n{agent_logs(cluster, 60)}")
        finally:
            api.delete_pod(name)
        samples.append(sample)
    # The agent's own restore duration per pod, from its timing summaries.
    own = {s.get("pod", ""): s for _, s in timing_summaries(agent_logs(cluster), "Restore")}
    for sample in samples:
        mine = (own.get(f"{NS}/{sample['pod']}") or {}).get("restore") or {}
        if "duration" in mine:
            sample["agent_restore_s"] = go_seconds(mine["duration"])
            sample["agent_phases_s"] = {k: go_seconds(v) for k, v in (mine.get("phases") or {}).items()}
    return samples


def start_agent(cluster: LocalCluster, api: Api, image: str, checkpoints: Path) -> int:
    """The agent pod running; its host PID."""
    node = cluster.real_node
    assert node is not None
    api.create(agent_pod(node, image, cluster.apiserver_port, checkpoints))
    wait("agent pod running", lambda: ((api.pod("nv-snapshot-agent") or {}).get("status") or {}).get("phase")
         == "Running", 120)  # fmt: skip
    pid: int = wait("agent process", lambda: host_pid(b"/usr/local/bin/snapshot-agent"), 30)
    time.sleep(3)  # informers sync
    return pid
