"""A real, single-machine Kubernetes control plane for tests and the local demo.

etcd + kube-apiserver (TLS, RBAC) + kube-scheduler + kube-controller-manager + kwok (fake GPU nodes and pod
lifecycle), all started from the binaries `scripts/test-env.sh` builds into the cache; optionally a real
node beside kwok (`RealNode`: kubelet + containerd + CNI bridge + kube-proxy, docs/real-node.md); and a
Prometheus (`LocalPrometheus`) scraping given targets every second.
"""

from dynamo_snapshot_dev.localcluster.cluster import LocalCluster, LocalClusterError
from dynamo_snapshot_dev.localcluster.components import Components, find_components
from dynamo_snapshot_dev.localcluster.nodes import gpu_node_manifest
from dynamo_snapshot_dev.localcluster.prometheus import LocalPrometheus, LocalPrometheusError
from dynamo_snapshot_dev.localcluster.realnode import RealNode, RealNodeError, RealNodeOptions

__all__ = [
    "Components",
    "LocalCluster",
    "LocalClusterError",
    "LocalPrometheus",
    "LocalPrometheusError",
    "RealNode",
    "RealNodeError",
    "RealNodeOptions",
    "find_components",
    "gpu_node_manifest",
]
