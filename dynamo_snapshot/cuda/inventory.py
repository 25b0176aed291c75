"""The node's GPUs and driver through NVML (nvidia-ml-py, imported lazily), named like GPU feature discovery.

Which "major" is which: GPU feature discovery (NVIDIA/k8s-device-plugin, internal/lm/nvml.go) sets
`nvidia.com/cuda.driver.major` to the major of the NVIDIA *kernel driver* version
(nvmlSystemGetDriverVersion "580.159.04" -> "580") and `nvidia.com/cuda.runtime.major` to the major of
the CUDA version the driver supports (nvmlSystemGetCudaDriverVersion_v2 13000 -> "13"). DriverInfo carries
both; NodeGpus.cuda_driver_major has the label's meaning ("580"), so it compares with the node label and
with DynamoCheckpoint's compatibility.cudaDriverMajor.

`gpu.product` is the NVML device name with each space replaced by '-' ("NVIDIA H200" -> "NVIDIA-H200",
internal/lm/resource.go), and `gpu.memory` the total memory in MiB.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dynamo_snapshot.cuda.checkpoint import format_gpu_uuid, parse_gpu_uuid
from dynamo_snapshot.cuda.errors import INSTALL_HINT, CudaUnavailableError

__all__ = [
    "DriverInfo",
    "GpuInfo",
    "NodeGpus",
    "NvmlUnavailableError",
    "cuda_major",
    "driver_info",
    "driver_major",
    "gfd_product",
    "gpu_memory_by_pid",
    "list_gpus",
    "node_gpus",
]

_MIB = 1 << 20


class NvmlUnavailableError(CudaUnavailableError):
    """nvidia-ml-py is not installed, or NVML cannot talk to a driver."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    product: str
    memory_total_mib: int
    memory_free_mib: int


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str  # "580.159.04"
    driver_major: str  # "580": GFD's nvidia.com/cuda.driver.major
    cuda_version: int  # 13000
    cuda_major: str  # "13": GFD's nvidia.com/cuda.runtime.major


@dataclass(frozen=True)
class NodeGpus:
    """What a checkpoint artifact records about the GPUs it was taken on.

    The fields are those of the artifact manifest's GPU record, so
    `GpuInfo(**dataclasses.asdict(node_gpus()))` fills it. The CUDA version (13 on driver 580) is in
    DriverInfo: it is not what GFD calls cuda.driver.major.
    """

    product: str  # GFD nvidia.com/gpu.product of the first GPU, e.g. "NVIDIA-H200"
    driver_version: str  # "580.159.04"
    # GFD nvidia.com/cuda.driver.major: the kernel driver's major, e.g. "580"; a string like the label
    cuda_driver_major: str
    count: int
    uuids: tuple[str, ...]  # NVML spelling, "GPU-...", by index
    memory_mib: int  # GFD nvidia.com/gpu.memory: the smallest total memory of these GPUs


def gfd_product(name: str) -> str:
    """GPU feature discovery's gpu.product for an NVML device name."""
    return name.replace(" ", "-")


def driver_major(driver_version: str) -> str:
    """The kernel driver's major as GFD splits it: "580.159.04" -> "580"."""
    parts = driver_version.strip().split(".")
    if not 2 <= len(parts) <= 3 or not parts[0].isdigit():
        raise ValueError(f"driver version {driver_version!r} is not X.Y[.Z]")
    return parts[0]


def cuda_major(cuda_version: int) -> str:
    """13000 -> "13" (NVML and cuDriverGetVersion give 1000 * major + 10 * minor)."""
    return str(cuda_version // 1000)


def _text(value: Any) -> str:
    # nvidia-ml-py before 11.5 returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


def _import_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailableError(f"nvidia-ml-py is not installed ({INSTALL_HINT})") from None


@contextlib.contextmanager
def _session(nvml: Any | None) -> Iterator[Any]:
    mod = nvml if nvml is not None else _import_nvml()
    try:
        mod.nvmlInit()
    except Exception as e:
        # pynvml raises NVMLError subclasses (library not found, driver not loaded, ...).
        raise NvmlUnavailableError(f"no NVIDIA driver: nvmlInit failed with {e}") from e
    try:
        yield mod
    finally:
        with contextlib.suppress(Exception):
            mod.nvmlShutdown()


def _driver_info(mod: Any) -> DriverInfo:
    version = _text(mod.nvmlSystemGetDriverVersion())
    get_cuda = getattr(mod, "nvmlSystemGetCudaDriverVersion_v2", None) or mod.nvmlSystemGetCudaDriverVersion
    cuda = int(get_cuda())
    return DriverInfo(version, driver_major(version), cuda, cuda_major(cuda))


def _gpus(mod: Any) -> list[GpuInfo]:
    gpus = []
    for index in range(int(mod.nvmlDeviceGetCount())):
        handle = mod.nvmlDeviceGetHandleByIndex(index)
        name = _text(mod.nvmlDeviceGetName(handle))
        memory = mod.nvmlDeviceGetMemoryInfo(handle)
        gpus.append(
            GpuInfo(
                index=index,
                uuid=_text(mod.nvmlDeviceGetUUID(handle)),
                name=name,
                product=gfd_product(name),
                memory_total_mib=int(memory.total) // _MIB,
                memory_free_mib=int(memory.free) // _MIB,
            )
        )
    return gpus


def driver_info(nvml: Any | None = None) -> DriverInfo:
    """Driver and CUDA versions. `nvml` replaces the pynvml module (tests)."""
    with _session(nvml) as mod:
        return _driver_info(mod)


def list_gpus(nvml: Any | None = None) -> list[GpuInfo]:
    """Every GPU NVML sees, by index."""
    with _session(nvml) as mod:
        return _gpus(mod)


def node_gpus(uuids: Iterable[str] | None = None, nvml: Any | None = None) -> NodeGpus:
    """The GPUs named by `uuids` (any spelling parse_gpu_uuid accepts), or all of them.

    Raises ValueError when a UUID names no GPU here, and NvmlUnavailableError without NVML or GPUs.
    """
    with _session(nvml) as mod:
        info = _driver_info(mod)
        gpus = _gpus(mod)
    if uuids is not None:
        by_uuid = {parse_gpu_uuid(g.uuid): g for g in gpus}
        wanted = [parse_gpu_uuid(u) for u in uuids]
        unknown = [format_gpu_uuid(u) for u in wanted if u not in by_uuid]
        if unknown:
            raise ValueError(f"no GPU with UUID {', '.join(unknown)} on this node")
        gpus = sorted({by_uuid[u].index: by_uuid[u] for u in wanted}.values(), key=lambda g: g.index)
    if not gpus:
        raise NvmlUnavailableError("NVML sees no GPU on this node")
    return NodeGpus(
        product=gpus[0].product,
        driver_version=info.driver_version,
        cuda_driver_major=info.driver_major,
        count=len(gpus),
        uuids=tuple(g.uuid for g in gpus),
        memory_mib=min(g.memory_total_mib for g in gpus),
    )


def gpu_memory_by_pid(nvml: Any | None = None) -> dict[int, int]:
    """MiB of GPU memory each compute process uses, summed over GPUs, as NVML reports it.

    Pids are as NVML sees them (the host's pid namespace). A process whose CUDA state is
    checkpointed is not listed. A process NVML lists without a figure (no permission) counts 0.
    """
    used: dict[int, int] = {}
    with _session(nvml) as mod:
        get = (
            getattr(mod, "nvmlDeviceGetComputeRunningProcesses_v3", None)
            or mod.nvmlDeviceGetComputeRunningProcesses
        )
        for index in range(int(mod.nvmlDeviceGetCount())):
            for proc in get(mod.nvmlDeviceGetHandleByIndex(index)):
                mem = getattr(proc, "usedGpuMemory", None)
                used[int(proc.pid)] = used.get(int(proc.pid), 0) + (int(mem) // _MIB if mem else 0)
    return used
