"""How the real node is set up, and the configuration its daemons read: containerd's TOML, the kubelet's
KubeletConfiguration and flags, kube-proxy's flags, the CNI network and the kubeconfigs."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_snapshot_dev.localcluster.pki import NodeCerts, Pki
from dynamo_snapshot_dev.localcluster.realnode.host import CNI_BIN_DIR, CNI_NETWORK, RUNC
from dynamo_snapshot_dev.localcluster.realnode.pod_images import PAUSE_IMAGE

# Test-infrastructure names (not the product's protocol): the taint that keeps kwok-bound pods off the node.
REAL_NODE_TAINT = "localcluster.dynamo-snapshot.dev/real-node"


@dataclass(frozen=True)
class RealNodeOptions:
    name: str = "real-node"
    bridge: str = "dsnap-cni0"
    pod_subnet: str = "10.244.0.0/24"
    node_ip: str = "10.244.0.1"
    kubelet_port: int = 10250
    # Where the machine has no iptables, the node runs without kube-proxy whatever this says.
    kube_proxy: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    # The machine's NVIDIA GPUs on the node (CDI spec, device plugin, labels); None: where /dev/nvidia0 is.
    gpus: bool | None = None
    # Each GPU advertised this many times (time-slicing): a one-GPU node runs several GPU pods.
    gpu_replicas: int = 1

    @property
    def prefix_len(self) -> int:
        return int(self.pod_subnet.split("/")[1])


def cni_conflist(options: RealNodeOptions, state_dir: Path) -> dict[str, Any]:
    """The pods' network: a bridge on this machine only, addresses from `options.pod_subnet`. Nothing in
    it needs iptables (no masquerade, no portmap), so it serves a machine without them as well."""
    return {
        "cniVersion": "0.4.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": options.bridge,
                "isGateway": True,
                # No egress: pods talk only to the host and each other, so no NAT rules on the host.
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": options.pod_subnet, "gateway": options.node_ip}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(state_dir / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }


def containerd_toml(
    *,
    root: Path,
    state_dir: Path,
    socket: Path,
    cni_conf_dir: Path,
    runc: Path = RUNC,
    cni_bin_dir: Path = CNI_BIN_DIR,
    cdi_spec_dirs: Sequence[Path] = (),
) -> str:
    """containerd's configuration; CDI is on exactly when ``cdi_spec_dirs`` names where its specs are."""
    cdi = f"enable_cdi = true\n  cdi_spec_dirs = {json.dumps([str(d) for d in cdi_spec_dirs])}"
    return f"""version = 3
root = "{root}"
state = "{state_dir}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{state_dir / "containerd.sock.ttrpc"}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.nri.v1.nri"]
  disable = true
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE.name}"
[plugins."io.containerd.cri.v1.runtime"]
  {cdi if cdi_spec_dirs else "enable_cdi = false"}
  # root has no CAP_SYS_RESOURCE in this VM: lowering the pause process's oom_score_adj is refused.
  restrict_oom_score_adj = true
  enable_criu = true
  enable_experimental_restore_via_create = true
  # Pod network namespaces under our state dir, so a stop finds and unmounts every one of them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin_dir}"]
    conf_dir = "{cni_conf_dir}"
    max_conf_num = 1
"""


def kubeconfig(*, server: str, ca_cert: Path, cert: Path, key: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "node"}}],
        "current-context": "local",
    }


def kubelet_configuration(
    options: RealNodeOptions,
    *,
    pki: Pki,
    certs: NodeCerts,
    containerd_socket: Path,
    pod_logs_dir: Path,
    healthz_port: int,
    cgroup_v2: bool = False,
) -> dict[str, Any]:
    sock = f"unix://{containerd_socket}"
    # 1.37 refuses cgroup v1 unless told otherwise (then a deprecation warning only); v2 needs no switch.
    cgroup_v1_switch = {} if cgroup_v2 else {"failCgroupV1": False}
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        **cgroup_v1_switch,
        # No systemd on these machines. Pods go under /kubepods at the root of the hierarchy (of each one on
        # v1): the kubelet and containerd stay in the cgroup they were started in, a sibling of it.
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": "/",
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        "address": options.node_ip,
        "port": options.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(certs.serving_cert),
        "tlsPrivateKeyFile": str(certs.serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": sock,
        "imageServiceEndpoint": sock,
        "podCIDR": options.pod_subnet,
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "podLogsDir": str(pod_logs_dir),
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        # Local images cannot be pulled again: image GC must never remove them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "registerWithTaints": [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
        "serializeImagePulls": False,
    }


def kubelet_argv(
    kubelet: Path,
    options: RealNodeOptions,
    *,
    config: Path,
    kubeconfig: Path,
    root_dir: Path,
    extra_labels: Mapping[str, str] | None = None,
) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in {**(extra_labels or {}), **options.labels}.items())
    return [
        str(kubelet),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={options.name}",
        f"--node-ip={options.node_ip}",
        f"--root-dir={root_dir}",
        *([f"--node-labels={labels}"] if labels else []),
        "--v=1",
    ]


def kube_proxy_argv(
    kube_proxy: Path, options: RealNodeOptions, *, kubeconfig: Path, healthz_port: int, metrics_port: int
) -> list[str]:
    return [
        str(kube_proxy),
        f"--kubeconfig={kubeconfig}",
        "--proxy-mode=iptables",
        f"--hostname-override={options.name}",
        f"--cluster-cidr={options.pod_subnet}",
        # Leave the host's conntrack and route_localnet sysctls alone.
        "--conntrack-max-per-core=0",
        "--iptables-localhost-nodeports=false",
        f"--healthz-bind-address=127.0.0.1:{healthz_port}",
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        "--v=1",
    ]
