"""The machine's NVIDIA GPUs on the real node, as a GPU node of a production cluster has them: a CDI spec
that containerd reads (device nodes and driver files injected into a container that asks), a device plugin
that advertises `nvidia.com/gpu` to the kubelet and answers its Allocate with CDI device names, and the
node labels GPU feature discovery would set, which the controller places restore pods by.

The CDI spec comes from `realnode.cdi.write_cdi_spec` and the device plugin is the node binaries'
`gpu-device-plugin`; this module decides whether the node has GPUs and puts the pieces in order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.cuda.errors import CudaUnavailableError
from dynamo_snapshot.cuda.inventory import NodeGpus, node_gpus
from dynamo_snapshot_dev.localcluster.realnode.facts import GPU_DEVICE
from dynamo_snapshot_dev.localcluster.realnode.host import DEVICE_PLUGIN_SOCKET, RealNodeError

CDI_MODULE = "dynamo_snapshot_dev.localcluster.realnode.cdi"


def wants_gpus(option: bool | None, gpu_devices: bool) -> bool:
    """The node's GPU option: as given, or (None) whether the machine has an NVIDIA GPU's device node.
    Asked for on a machine without one, it is refused."""
    if option is None:
        return gpu_devices
    if option and not gpu_devices:
        raise RealNodeError(
            f"gpus=True but this machine has no NVIDIA GPU ({GPU_DEVICE} is missing): leave gpus unset "
            "to start the node without GPUs"
        )
    return option


def gpu_labels(gpus: NodeGpus) -> dict[str, str]:
    """The labels GPU feature discovery puts on a node with these GPUs (the ones kwok's fake GPU nodes
    carry: `localcluster.nodes.gpu_node_manifest`)."""
    return {
        protocol.LABEL_GPU_PRESENT: "true",
        protocol.LABEL_GPU_PRODUCT: gpus.product,
        protocol.LABEL_GPU_COUNT: str(gpus.count),
        protocol.LABEL_CUDA_DRIVER_MAJOR: gpus.cuda_driver_major,
    }


def read_node_gpus(read: Callable[[], NodeGpus] = node_gpus) -> NodeGpus:
    """The machine's GPUs through NVML, or a RealNodeError that says why they cannot be read."""
    try:
        return read()
    except CudaUnavailableError as e:
        raise RealNodeError(f"the node's GPUs cannot be read through NVML: {e}") from None


def write_cdi_spec(directory: Path) -> Path:
    """The machine's CDI spec for `nvidia.com/gpu`, written into ``directory`` (containerd's
    cdi_spec_dirs) by the generator in `realnode.cdi`."""
    try:
        cdi: Any = importlib.import_module(CDI_MODULE)
    except ImportError:
        raise RealNodeError(f"the CDI spec generator ({CDI_MODULE}) is not in this checkout") from None
    directory.mkdir(parents=True, exist_ok=True)
    refused: type[Exception] = getattr(cdi, "CdiSpecError", RuntimeError)
    try:
        path: Path = cdi.write_cdi_spec(directory)
    except refused as e:
        raise RealNodeError(f"the GPUs' CDI spec: {e}") from None
    return path


def device_plugin_argv(plugin: Path, cdi_dir: Path, replicas: int = 1) -> list[str]:
    """The device plugin finds the GPUs in the node's CDI spec (each named by UUID) and registers with
    the kubelet through its socket in /var/lib/kubelet/device-plugins, serving beside it on its own; with
    ``replicas`` > 1 it advertises each GPU that many times (time-slicing, as NVIDIA's plugin offers)."""
    argv = [str(plugin), f"--cdi-spec-dir={cdi_dir}", f"--socket={DEVICE_PLUGIN_SOCKET.name}"]
    return [*argv, f"--replicas={replicas}"] if replicas > 1 else argv


def advertised_gpus(node: dict[str, Any]) -> int:
    """How many `nvidia.com/gpu` a Node object says it can give pods."""
    value = (node.get("status") or {}).get("allocatable", {}).get(protocol.RESOURCE_GPU, "0")
    try:
        return int(value)
    except ValueError:
        return 0
