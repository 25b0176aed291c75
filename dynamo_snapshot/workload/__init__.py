"""The SDK a worker calls to be checkpointed and restored: the handshake through the control directory,
and GPU memory (KV cache, weights) that is left out of the checkpoint and taken back after the restore.

Imports without torch or cuda-python: both are loaded on first use.
"""

from dynamo_snapshot.api.protocol import FILE_WEIGHTS_MANIFEST
from dynamo_snapshot.workload.gpu_memory import (
    DEFAULT_POOL,
    KIND_KV,
    KIND_WEIGHTS,
    RegionPool,
    VmmRegion,
    allocation_granularity,
    device_memory_info,
)
from dynamo_snapshot.workload.handshake import (
    DEFAULT_POLL_INTERVAL,
    NoControlDirError,
    RestoreInfo,
    SnapshotHandshake,
    SnapshotHook,
    control_dir,
    maybe_checkpoint_and_wait,
    maybe_checkpoint_and_wait_async,
    maybe_signal_ready,
    maybe_signal_ready_async,
    parse_restore_complete,
)
from dynamo_snapshot.workload.kv_cache import KvCache
from dynamo_snapshot.workload.offload import GpuOffload, OffloadReport
from dynamo_snapshot.workload.standby import run_standby, standby_requested
from dynamo_snapshot.workload.weights import (
    LoadResult,
    OffloadManifest,
    SaveResult,
    WeightRegion,
    WeightsFile,
    WeightsFileError,
    pack_module,
    read_offload_manifest,
    read_weights_manifest,
    wait_for_weights_verified,
    warm_page_cache,
    warm_weights,
    weights_check_pending,
)

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_POOL",
    "FILE_WEIGHTS_MANIFEST",
    "KIND_KV",
    "KIND_WEIGHTS",
    "GpuOffload",
    "KvCache",
    "LoadResult",
    "NoControlDirError",
    "OffloadManifest",
    "OffloadReport",
    "RegionPool",
    "RestoreInfo",
    "SaveResult",
    "SnapshotHandshake",
    "SnapshotHook",
    "VmmRegion",
    "WeightRegion",
    "WeightsFile",
    "WeightsFileError",
    "allocation_granularity",
    "control_dir",
    "device_memory_info",
    "maybe_checkpoint_and_wait",
    "maybe_checkpoint_and_wait_async",
    "maybe_signal_ready",
    "maybe_signal_ready_async",
    "pack_module",
    "parse_restore_complete",
    "read_offload_manifest",
    "read_weights_manifest",
    "run_standby",
    "standby_requested",
    "wait_for_weights_verified",
    "warm_page_cache",
    "warm_weights",
    "weights_check_pending",
]
