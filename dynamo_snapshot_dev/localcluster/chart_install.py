"""The project's Helm chart installed on the real kubelet node as docs/install.md tells a user to install it
on a node without a registry: the controller and agent images built from this checkout
(`project_images`) imported into the node's containerd, then `helm install -f values-local.yaml -f
<this node's values> --wait`. The chart test and `dynamo-snapshot-demo --chart` both install it this way.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from dynamo_snapshot_dev.localcluster.cluster import LocalCluster, LocalClusterError
from dynamo_snapshot_dev.localcluster.components import SETUP_HINT, ComponentsMissingError
from dynamo_snapshot_dev.localcluster.images import project_root
from dynamo_snapshot_dev.localcluster.project_images import agent_image_archive, controller_image_archive
from dynamo_snapshot_dev.localcluster.realnode import REAL_NODE_TAINT, RUNC_ROOT, RealNode

CHART = project_root() / "helm" / "dynamo-snapshot"
LOCAL_VALUES = CHART / "values-local.yaml"


def node_values(
    node: RealNode,
    store: Path,
    *,
    capabilities: list[str],
    watch_namespace: str | None = None,
    prometheus_url: str | None = None,
) -> dict[str, Any]:
    """What a user sets for this node beyond values-local.yaml: where the runtime keeps its state (the
    real node's containerd, kubelet and runc roots), a node-local artifact store under ``store``, the
    node's taint, the agent's ``capabilities``; the controller watching one namespace and asking one
    Prometheus where given.

    Callers give what a checkpoint and a restore of the workers here need (agent/privileges.py: the
    required set and what the workers hold, containerd's default): the chart's default adds what workers
    of other users need, and CAP_SYS_RESOURCE is not in this machine's bounding set (a container asking for
    it does not start)."""
    on_node = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
    }
    controller: dict[str, Any] = dict(on_node)
    if watch_namespace is not None:
        controller["watchNamespace"] = watch_namespace
    if prometheus_url is not None:
        controller["prometheusUrl"] = prometheus_url
    return {
        "controller": controller,
        "agent": {
            **on_node,
            "controlRoot": str(store / "control"),
            "stateRoot": str(store / "runtime"),
            "runtimeHostPaths": [str(RUNC_ROOT), str(node.state_dir), str(node.workdir), "/sys/fs/cgroup"],
            "seccompProfile": {"kubeletRoot": str(node.kubelet_root)},
            "capabilities": capabilities,
            # CPU workers: no CUDA host copy for the SDK to drop; the rewrite takes their zero pages out.
            "dropZeroPages": "auto",
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "2Gi"}},
        },
        "artifacts": {"hostPath": str(store / "artifacts")},
    }


def import_images(node: RealNode) -> None:
    """The controller and agent images of this checkout, built where absent, in the node's containerd."""
    for _, archive in (controller_image_archive(), agent_image_archive()):
        node.ctr("images", "import", str(archive), timeout=300)


def helm(cluster: LocalCluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    binary = cluster.components.helm
    if binary is None:
        raise ComponentsMissingError(f"missing in {cluster.components.bin_dir}: helm — {SETUP_HINT}")
    return subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=cluster.env(),
    )


def install_args(namespace: str, values_file: Path) -> list[str]:
    """The arguments of `helm install` and of every later `helm upgrade` of the release."""
    return ["-n", namespace, "-f", str(LOCAL_VALUES), "-f", str(values_file), "--wait", "--timeout", "180s"]


def install(
    cluster: LocalCluster,
    node: RealNode,
    release: str,
    namespace: str,
    values: dict[str, Any],
    values_file: Path,
) -> list[str]:
    """Import the images and install the chart as ``release`` into ``namespace`` (created if absent),
    with ``values`` written to ``values_file``; returns the arguments that upgrade it with the same
    values."""
    import_images(node)
    cluster.kubectl("create", "namespace", namespace, check=False)
    # JSON, a YAML subset with every string quoted: PyYAML leaves a string such as 86373e69 plain and
    # helm reads it as a number.
    values_file.write_text(json.dumps(values, indent=2))
    args = install_args(namespace, values_file)
    done = helm(cluster, "install", release, str(CHART), *args, timeout=240)
    if done.returncode != 0:
        raise LocalClusterError(f"helm install {release} failed: {done.stderr.strip()[-2000:]}")
    return args
