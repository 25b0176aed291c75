"""The real node's configuration as each machine gets it: cgroup v1 or v2, with or without iptables, with or
without GPUs. Rendered and parsed here; the v1 machine runs it for real (test_real_node.py)."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.cuda.inventory import NodeGpus, NvmlUnavailableError
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError
from dynamo_snapshot_dev.localcluster.nodes import gpu_node_manifest
from dynamo_snapshot_dev.localcluster.pki import NodeCerts, Pki
from dynamo_snapshot_dev.localcluster.realnode import (
    RealNodeError,
    RealNodeOptions,
    configs,
    find_node_components,
    gpu,
    host,
    pod_images,
)
from dynamo_snapshot_dev.localcluster.realnode.links import LinkError, ifreq_flags, ifreq_inet

H200 = NodeGpus(
    product="NVIDIA-H200",
    driver_version="580.159.04",
    cuda_driver_major="580",
    count=1,
    uuids=("GPU-de4bc798-4095-f0b7-1d1d-b727ab7f0dc1",),
    memory_mib=143771,
)


def _kubelet_config(*, cgroup_v2: bool) -> dict[str, Any]:
    p = Path("/pki")
    return configs.kubelet_configuration(
        RealNodeOptions(),
        pki=Pki(*([p] * 8)),
        certs=NodeCerts(p, p, p, p),
        containerd_socket=Path("/run/x/containerd.sock"),
        pod_logs_dir=Path("/logs"),
        healthz_port=1234,
        cgroup_v2=cgroup_v2,
    )


def test_kubelet_on_cgroup_v1_is_told_to_accept_it_and_on_v2_needs_nothing() -> None:
    v1, v2 = _kubelet_config(cgroup_v2=False), _kubelet_config(cgroup_v2=True)
    assert v1["failCgroupV1"] is False
    assert "failCgroupV1" not in v2
    for config in (v1, v2):
        assert (config["cgroupDriver"], config["cgroupRoot"], config["cgroupsPerQOS"]) == (
            "cgroupfs",
            "/",
            True,
        )
    assert {k: v for k, v in v1.items() if k != "failCgroupV1"} == v2


def _containerd(**kw: Any) -> dict[str, Any]:
    text = configs.containerd_toml(
        root=Path("/r"), state_dir=Path("/run/s"), socket=Path("/run/s/c.sock"), cni_conf_dir=Path("/n"), **kw
    )
    parsed: dict[str, Any] = tomllib.loads(text)
    return parsed


def test_containerd_runs_the_given_runc_and_plugins_with_cdi_only_for_gpus() -> None:
    plain = _containerd(runc=Path("/cache/bin/runc"), cni_bin_dir=Path("/cache/bin/cni"))
    cri = plain["plugins"]["io.containerd.cri.v1.runtime"]
    assert cri["enable_cdi"] is False
    assert "cdi_spec_dirs" not in cri
    runc = cri["containerd"]["runtimes"]["runc"]["options"]
    assert runc == {"SystemdCgroup": False, "BinaryName": "/cache/bin/runc"}
    assert cri["cni"]["bin_dirs"] == ["/cache/bin/cni"]

    gpus = _containerd(cdi_spec_dirs=[Path("/run/s/cdi")])
    cri = gpus["plugins"]["io.containerd.cri.v1.runtime"]
    assert (cri["enable_cdi"], cri["cdi_spec_dirs"]) == (True, ["/run/s/cdi"])
    assert cri["restrict_oom_score_adj"] is True
    assert cri["enable_criu"] is True


def test_the_pod_network_needs_no_iptables() -> None:
    conf = configs.cni_conflist(RealNodeOptions(), Path("/run/s"))
    assert [p["type"] for p in conf["plugins"]] == ["bridge", "loopback"], "no portmap, no firewall"
    bridge = conf["plugins"][0]
    assert bridge["ipMasq"] is False
    assert bridge["isGateway"] is True
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.244.0.0/24", "gateway": "10.244.0.1"}]]


def test_node_labels_are_the_gpu_labels_under_the_callers() -> None:
    argv = configs.kubelet_argv(
        Path("/bin/kubelet"),
        RealNodeOptions(labels={protocol.LABEL_GPU_PRODUCT: "mine", "team": "a"}),
        config=Path("/c"),
        kubeconfig=Path("/k"),
        root_dir=Path("/root-dir"),
        extra_labels=gpu.gpu_labels(H200),
    )
    labels = dict(
        kv.split("=") for kv in next(a for a in argv if a.startswith("--node-labels="))[14:].split(",")
    )
    assert labels[protocol.LABEL_GPU_PRODUCT] == "mine", "what the caller asks for wins"
    assert labels[protocol.LABEL_GPU_COUNT] == "1"
    assert labels[protocol.LABEL_CUDA_DRIVER_MAJOR] == "580"
    assert labels["team"] == "a"
    plain = configs.kubelet_argv(
        Path("/k"), RealNodeOptions(), config=Path("/c"), kubeconfig=Path("/k"), root_dir=Path("/r")
    )
    assert not any(a.startswith("--node-labels") for a in plain)


def test_gpu_labels_are_those_the_fake_gpu_nodes_carry() -> None:
    fake = gpu_node_manifest("n", product="NVIDIA-H200", gpus=1, driver_major=580)["metadata"]["labels"]
    labels = gpu.gpu_labels(H200)
    assert labels == {k: fake[k] for k in labels}
    assert set(labels) == {k for k in fake if k.startswith("nvidia.com/")}


def test_the_gpu_option_follows_the_machine_unless_given() -> None:
    assert gpu.wants_gpus(None, gpu_devices=True) is True
    assert gpu.wants_gpus(None, gpu_devices=False) is False
    assert gpu.wants_gpus(False, gpu_devices=True) is False
    with pytest.raises(RealNodeError, match=r"gpus=True but this machine has no NVIDIA GPU \(/dev/nvidia0"):
        gpu.wants_gpus(True, gpu_devices=False)


def test_gpus_unreadable_through_nvml_say_why() -> None:
    def no_driver() -> NodeGpus:
        raise NvmlUnavailableError("no NVIDIA driver: nvmlInit failed with Driver Not Loaded")

    with pytest.raises(RealNodeError, match="cannot be read through NVML: no NVIDIA driver"):
        gpu.read_node_gpus(no_driver)
    assert gpu.read_node_gpus(lambda: H200) is H200


def test_the_device_plugin_reads_the_nodes_cdi_spec_and_serves_beside_the_kubelet() -> None:
    argv = gpu.device_plugin_argv(Path("/cache/bin/gpu-device-plugin"), Path("/run/dsnap-real-node/cdi"))
    assert argv == [
        "/cache/bin/gpu-device-plugin",
        "--cdi-spec-dir=/run/dsnap-real-node/cdi",
        "--socket=dsnap-gpu.sock",
    ]


def test_advertised_gpus_from_the_node_status() -> None:
    assert gpu.advertised_gpus({"status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "16"}}}) == 8
    assert gpu.advertised_gpus({"status": {"allocatable": {"cpu": "16"}}}) == 0
    assert gpu.advertised_gpus({}) == 0


def test_the_cdi_spec_is_written_by_the_generator_into_the_given_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def write(directory: Path) -> Path:
        spec = directory / "nvidia.com-gpu.json"
        spec.write_text("{}")
        return spec

    monkeypatch.setitem(sys.modules, gpu.CDI_MODULE, types.SimpleNamespace(write_cdi_spec=write))
    assert gpu.write_cdi_spec(tmp_path / "cdi") == tmp_path / "cdi" / "nvidia.com-gpu.json"

    class CdiSpecError(RuntimeError):
        pass

    def refuse(directory: Path) -> Path:
        raise CdiSpecError("refusing to write a CDI spec that names missing device nodes: /dev/nvidia0")

    fake = types.SimpleNamespace(write_cdi_spec=refuse, CdiSpecError=CdiSpecError)
    monkeypatch.setitem(sys.modules, gpu.CDI_MODULE, fake)
    with pytest.raises(RealNodeError, match=r"^the GPUs' CDI spec: refusing .* /dev/nvidia0$"):
        gpu.write_cdi_spec(tmp_path / "cdi")
    monkeypatch.setitem(sys.modules, gpu.CDI_MODULE, None)  # the import fails
    with pytest.raises(RealNodeError, match="CDI spec generator"):
        gpu.write_cdi_spec(tmp_path / "cdi")


def _bin_dir(tmp_path: Path, names: list[str]) -> Path:
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return tmp_path


NODE_BINARIES = ["kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "criu", "runc"]
CNI = ["cni/bridge", "cni/host-local", "cni/loopback"]


def test_without_iptables_kube_proxy_is_neither_needed_nor_used(tmp_path: Path) -> None:
    base = _bin_dir(tmp_path, [*NODE_BINARIES, *CNI])
    comps = find_node_components(base, iptables=False)
    assert comps.kube_proxy is None
    assert (comps.runc, comps.cni_bin_dir) == (base / "runc", base / "cni"), "the bin dir's own first"
    assert comps.gpu_device_plugin is None
    with pytest.raises(ComponentsMissingError) as err:
        find_node_components(base, iptables=True)
    assert str(err.value).startswith(f"the real node needs: {base / 'kube-proxy'} — ")


def test_the_bin_dirs_device_plugin_is_found(tmp_path: Path) -> None:
    base = _bin_dir(tmp_path, [*NODE_BINARIES, *CNI, "gpu-device-plugin", "kube-proxy"])
    comps = find_node_components(base, iptables=True)
    assert comps.gpu_device_plugin == base / "gpu-device-plugin"
    assert comps.kube_proxy == base / "kube-proxy"


def test_missing_cni_plugins_are_named_where_they_are_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _bin_dir(tmp_path, [*NODE_BINARIES, "cni/bridge"])
    monkeypatch.setattr(host, "CNI_BIN_DIR", tmp_path / "no-system-cni")
    with pytest.raises(ComponentsMissingError) as err:
        find_node_components(base, iptables=False)
    assert (
        f"the CNI plugins bridge, host-local, loopback (in {base / 'cni'} or {tmp_path / 'no-system-cni'})"
        in str(err.value)
    )


def test_ifreq_layouts_are_the_kernels() -> None:
    assert len(ifreq_flags("dsnap-cni0", 0x1043)) == 40
    assert ifreq_flags("br0", 1)[:16] == b"br0" + b"\0" * 13
    inet = ifreq_inet("br0", "10.244.0.1")
    assert len(inet) == 40
    assert inet[16:18] == (2).to_bytes(2, sys.byteorder), "sa_family AF_INET in host order"
    assert inet[20:24] == bytes([10, 244, 0, 1])
    for bad in ("", "a-name-of-16-chr", "a/b"):
        with pytest.raises(LinkError, match="not a valid interface name"):
            ifreq_flags(bad, 0)


def test_images_whose_makings_the_machine_lacks_are_left_out_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pod_images, "WORKER_PYTHON", tmp_path / "no-python3.11")
    images = pod_images.build_node_images(tmp_path / "with-busybox")
    assert [a.name for a in images.archives] == ["pause.tar", "busybox.tar"]
    assert images.worker is None
    assert images.skipped == [f"the CPU worker image: no {tmp_path / 'no-python3.11'} on this machine"]

    monkeypatch.setattr(pod_images, "BUSYBOX", tmp_path / "no-busybox")
    images = pod_images.build_node_images(tmp_path / "bare")
    assert [a.name for a in images.archives] == ["pause.tar"], "the sandbox image is always there"
    assert images.skipped == [
        f"the test image {pod_images.TEST_IMAGE.name}: no {tmp_path / 'no-busybox'} on this machine",
        f"the CPU worker image: no {tmp_path / 'no-python3.11'} or {tmp_path / 'no-busybox'} on this machine",
    ]
