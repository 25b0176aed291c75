"""The SDK a worker calls to be checkpointed and restored: the handshake through the control directory."""

from dynamo_snapshot.workload.handshake import (
    DEFAULT_POLL_INTERVAL,
    NoControlDirError,
    RestoreInfo,
    SnapshotHandshake,
    control_dir,
    maybe_checkpoint_and_wait,
    maybe_checkpoint_and_wait_async,
    maybe_signal_ready,
    maybe_signal_ready_async,
)

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "NoControlDirError",
    "RestoreInfo",
    "SnapshotHandshake",
    "control_dir",
    "maybe_checkpoint_and_wait",
    "maybe_checkpoint_and_wait_async",
    "maybe_signal_ready",
    "maybe_signal_ready_async",
]
