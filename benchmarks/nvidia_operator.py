"""NVIDIA's snapshot operator (ai-dynamo/snapshot operator/, its manager) on the real kubelet node, for
vs_nvidia_snapshot.py: its image, the operator objects of their chart `charts/snapshot` rendered by helm, and
a checkpoint as their README has it: the caller creates a PodSnapshot; the operator creates the bound
PodSnapshotContent (labelled with the source pod's node), the node's agent captures the pod and sets the
content Ready, and the operator mirrors that onto the PodSnapshot.

The image is their operator Dockerfile's: /manager (the entrypoint) and /crd-installer, run as 65532, here
on an empty root instead of their distroless base (the binaries are static). The chart's Deployment, its
ServiceAccount, ClusterRole/Binding and leader-election Role/RoleBinding are applied as rendered, with the
image's name and pullPolicy Never given as chart values (no registry: the archive is imported into the
node's containerd), and these changes for this host:
- a toleration of the test bed's taint on the real node (REAL_NODE_TAINT), which keeps kwok-bound pods off
  it; their Deployment has no nodeSelector or tolerations, so without it the pod is never scheduled.
- `crdUpgrade.enabled: false` (their documented switch; the CRDs are applied from the chart's crds/ first,
  the command their values.yaml gives for that case). With it on, their crd-installer init container exits
  1 and the manager never starts: it applies all three embedded CRDs, and the chart's ClusterRole grants
  get/patch on podsnapshots and podsnapshotcontents only, so the Get of snapshotjobs.nvidia.com is
  forbidden. Its log here: `CRD installation failed {"error": "get CRD \"snapshotjobs.nvidia.com\":
  customresourcedefinitions.apiextensions.k8s.io \"snapshotjobs.nvidia.com\" is forbidden: User
  \"system:serviceaccount:nv-snapshot:snap-snapshot-operator\" cannot get resource
  \"customresourcedefinitions\" in API group \"apiextensions.k8s.io\" at the cluster scope"}`
  (`install_operator(..., crd_upgrade=True)` shows it again).
The operator reaches the apiserver through the `kubernetes` Service (kube-proxy on the node), as in any
cluster: its pod is not on the host network.

Their manager at b7e707c runs the PodSnapshot controller only: the SnapshotJob reconciler is in
operator/internal/controller but cmd/manager/main.go does not register it, so a SnapshotJob is not acted on
and is not used here. The operator takes no Lease per checkpoint (their agent takes
`checkpoint-lease-<checkpoint id>` while it dumps); its one Lease is the manager's leader election
(`snapshot-operator.nvidia.com`), which is waited for before the first PodSnapshot is created. Its log in
each kept run has one `Reconciler error` on the first PodSnapshot, a conflict on the status write that
records the bound content (`the object has been modified`), which controller-runtime retries; the
PodSnapshot then became Ready.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.nvidia_peer import (
    NS,
    RELEASE,
    Api,
    Peer,
    Workload,
    agent_logs,
    captured,
    cond,
    render_chart,
    wait,
)
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.images import Entry, ImageRef, materialize, write_oci_archive
from dynamo_snapshot_dev.localcluster.realnode import REAL_NODE_TAINT

OPERATOR_BINS = ("manager", "crdinstaller")
OPERATOR = f"{RELEASE}-snapshot-operator"
LEADER_LEASE = "snapshot-operator.nvidia.com"  # cmd/manager/main.go LeaderElectionID
GROUP = "/apis/nvidia.com/v1alpha1"


def operator_image(peer: Peer, out_dir: Path) -> tuple[ImageRef, Path]:
    """/manager and /crd-installer as their operator Dockerfile puts them, user 65532, and a /tmp."""
    entries = [
        Entry("manager", src=peer.bin / "manager", mode=0o755),
        Entry("crd-installer", src=peer.bin / "crdinstaller", mode=0o755),
        Entry("tmp", mode=0o1777, is_dir=True),
    ]
    rootfs = out_dir / "operator-rootfs"
    materialize(rootfs, entries)
    image = ImageRef("localhost/vs-nvidia/snapshot-operator", str(int(time.time())))
    archive = write_oci_archive(
        out_dir / "operator.tar", rootfs, image, entrypoint=["/manager"], user="65532", compresslevel=1
    )
    return image, archive


def operator_objects(
    peer: Peer, workdir: Path, image: ImageRef, *, crd_upgrade: bool = False
) -> list[dict[str, Any]]:
    """The chart's operator objects (component label `operator`) rendered with the local image; the
    Deployment's pod tolerates the real node's taint (the module docstring says why)."""
    values = {
        "image": {"operator": {"repository": image.repository, "tag": image.tag, "pullPolicy": "Never"}},
        "crdUpgrade": {"enabled": crd_upgrade},
    }
    objs = render_chart(peer, workdir, values)
    mine = [
        o
        for o in objs
        if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "operator"
    ]
    for obj in mine:
        if obj["kind"] == "Deployment":
            spec = obj["spec"]["template"]["spec"]
            spec["tolerations"] = [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]
    return mine


def operator_logs(cluster: LocalCluster, container: str = "manager", tail: int = 200) -> str:
    argv = ["logs", "-n", NS, f"deploy/{OPERATOR}", "-c", container, f"--tail={tail}"]
    return cluster.kubectl(*argv, check=False).stdout


def install_operator(
    cluster: LocalCluster, api: Api, peer: Peer, workdir: Path, image: ImageRef, *, crd_upgrade: bool = False
) -> dict[str, Any]:
    """Apply the operator objects; wait for its pod to run and hold the leader Lease. What was applied."""
    objs = operator_objects(peer, workdir, image, crd_upgrade=crd_upgrade)
    for obj in objs:
        namespaced = obj["kind"] in ("ServiceAccount", "Role", "RoleBinding", "Deployment")
        cluster.apply(obj, namespace=NS if namespaced else None)
    t0 = time.monotonic()

    def leader() -> Any:
        lease = api.get("lease", "-n", NS, LEADER_LEASE)
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    try:
        holder = wait("the operator's leader Lease", leader, 120, 0.5)
    except TimeoutError:
        pods = api.get("pods", "-n", NS, "-l", "app.kubernetes.io/component=operator")
        status = [p.get("status") for p in (pods or {}).get("items") or []]
        raise RuntimeError(
            f"operator not running: {json.dumps(status)[:3000]}\n"
            f"crd-installer: {operator_logs(cluster, 'crd-installer')}\nmanager: {operator_logs(cluster)}"
        ) from None
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    return {
        "image": image.name,
        "objects": sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs),
        "pod_spec": deployment["spec"]["template"]["spec"],
        "leader": holder,
        "applied_to_leader_s": round(time.monotonic() - t0, 2),
    }


def checkpoint_by_operator(
    cluster: LocalCluster, api: Api, work: Workload, checkpoints: Path, timeout: float
) -> dict[str, Any]:
    """A PodSnapshot of the source pod's container main, timed from its create call to its Ready condition
    (polled every 50 ms); the operator creates the PodSnapshotContent and the agent captures."""
    body = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": work.ckpt_id, "namespace": NS},
        "spec": {"source": {"podRef": {"name": work.source, "containers": ["main"]}}},
    }
    path = f"{GROUP}/namespaces/{NS}/podsnapshots"
    t0 = time.monotonic()
    api.call("POST", path, body)

    def done() -> Any:
        snap = api.call("GET", f"{path}/{work.ckpt_id}")
        if cond(snap, "Failed"):
            raise RuntimeError(f"checkpoint failed: {json.dumps(snap['status'])}\n{agent_logs(cluster, 40)}")
        return snap if cond(snap, "Ready") else None

    try:
        ready = wait("PodSnapshot Ready", done, timeout, 0.05)
    except TimeoutError:
        logs = f"agent: {agent_logs(cluster, 60)}\noperator: {operator_logs(cluster, tail=60)}"
        raise RuntimeError(f"checkpoint timed out\n{logs}") from None
    wall = time.monotonic() - t0
    content_name = ready["status"].get("boundSnapshotContentName")
    content = api.call("GET", f"{GROUP}/podsnapshotcontents/{content_name}") if content_name else None
    return {
        "path": "PodSnapshot -> their operator -> PodSnapshotContent -> their agent",
        "podsnapshot_created_to_ready_s": round(wall, 3),
        "status": ready["status"],
        "content": {
            "name": content_name,
            "labels": (content or {}).get("metadata", {}).get("labels"),
            "spec": (content or {}).get("spec"),
            "status": (content or {}).get("status"),
        },
        **captured(cluster, work, checkpoints, content_name or ""),
    }
