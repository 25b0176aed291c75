"""CUDA mechanics: the driver's process checkpoint API, GPU processes in /proc, and the GPU inventory.

Imports without cuda-python or nvidia-ml-py (both are the `gpu` extra): they are loaded on first use,
and calls raise CudaUnavailableError when they are missing.
"""

from dynamo_snapshot.cuda.checkpoint import (
    DEFAULT_LOCK_TIMEOUT_MS,
    MIN_CUDA_DRIVER_VERSION,
    CudaCheckpointer,
    ProcessState,
    cuda_available,
    format_gpu_uuid,
    parse_gpu_uuid,
)
from dynamo_snapshot.cuda.errors import (
    CudaError,
    CudaUnavailableError,
    DriverTooOldError,
    NotCudaProcessError,
    WrongStateError,
)
from dynamo_snapshot.cuda.inventory import (
    DriverInfo,
    GpuInfo,
    NodeGpus,
    NvmlUnavailableError,
    driver_info,
    gfd_product,
    gpu_memory_by_pid,
    list_gpus,
    node_gpus,
)
from dynamo_snapshot.cuda.processes import (
    children,
    find_cuda_pids,
    gpu_device_fds,
    process_tree,
    uses_gpu,
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "MIN_CUDA_DRIVER_VERSION",
    "CudaCheckpointer",
    "CudaError",
    "CudaUnavailableError",
    "DriverInfo",
    "DriverTooOldError",
    "GpuInfo",
    "NodeGpus",
    "NotCudaProcessError",
    "NvmlUnavailableError",
    "ProcessState",
    "WrongStateError",
    "children",
    "cuda_available",
    "driver_info",
    "find_cuda_pids",
    "format_gpu_uuid",
    "gfd_product",
    "gpu_device_fds",
    "gpu_memory_by_pid",
    "list_gpus",
    "node_gpus",
    "parse_gpu_uuid",
    "process_tree",
    "uses_gpu",
]
