"""A real Kubernetes node on this machine: kubelet + containerd 2.x + runc + CNI bridge (+ kube-proxy).

It joins a running `LocalCluster` next to the kwok nodes. Pods on it are real containers (runc state under
/run/containerd/runc/k8s.io/<containerID>), addressed on a bridge that lives only on this machine; images
come from local OCI archives (`localcluster.images`), so pods use `imagePullPolicy: Never`.

The node is tainted (`REAL_NODE_TAINT`) so that pods written for kwok nodes never land on it; pods meant for
it tolerate the taint (`RealNode.pod_overrides`). One real node per machine: a lock under /run refuses a
second one, and a start after a killed run first removes what that run left (processes, mounts, cgroups,
netns, the bridge, iptables chains where iptables is installed).

`node` holds `RealNode`; `host` the host paths, binaries and command runner; `facts` what the machine offers
(cgroup v1 or v2, iptables, GPUs), read at start; `configs` the daemons' configuration; `links` the pods'
bridge; `gpu` the GPUs on the node (CDI spec, device plugin, labels); `pod_images` the images and seccomp
profile; `traces` what a node leaves on the host.
"""

from dynamo_snapshot_dev.localcluster.realnode.configs import REAL_NODE_TAINT, RealNodeOptions
from dynamo_snapshot_dev.localcluster.realnode.host import (
    CNI_BIN_DIR,
    CONTAINERD_NAMESPACE,
    IP_FORWARD,
    LOCK_PATH,
    RUNC,
    RUNC_ROOT,
    NodeComponents,
    RealNodeError,
    find_node_components,
)
from dynamo_snapshot_dev.localcluster.realnode.node import RealNode
from dynamo_snapshot_dev.localcluster.realnode.pod_images import (
    NO_IO_URING_PROFILE,
    NO_IO_URING_SECCOMP,
    PAUSE_IMAGE,
    TEST_IMAGE,
)

__all__ = [
    "CNI_BIN_DIR",
    "CONTAINERD_NAMESPACE",
    "IP_FORWARD",
    "LOCK_PATH",
    "NO_IO_URING_PROFILE",
    "NO_IO_URING_SECCOMP",
    "PAUSE_IMAGE",
    "REAL_NODE_TAINT",
    "RUNC",
    "RUNC_ROOT",
    "TEST_IMAGE",
    "NodeComponents",
    "RealNode",
    "RealNodeError",
    "RealNodeOptions",
    "find_node_components",
]
