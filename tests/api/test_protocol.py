"""The protocol vocabulary: exact spellings (shared with Dynamo where it has them) and key rules."""

from __future__ import annotations

import re

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.protocol import SnapshotStatus, per_container

# Spelled exactly as in NVIDIA Dynamo's snapshot code, so pods stay readable by its tooling.
DYNAMO_SPELLINGS = {
    "LABEL_CHECKPOINT_HASH": "nvidia.com/snapshot-checkpoint-hash",
    "LABEL_CHECKPOINT_SOURCE": "nvidia.com/snapshot-is-checkpoint-source",
    "LABEL_CHECKPOINT_ID": "nvidia.com/snapshot-checkpoint-id",
    "LABEL_RESTORE_TARGET": "nvidia.com/snapshot-is-restore-target",
    "ANNOTATION_RESTORE_FROM": "nvidia.com/restore-from",
    "ANNOTATION_TARGET_CONTAINERS": "nvidia.com/snapshot-target-containers",
    "ANNOTATION_CHECKPOINT_STATUS": "nvidia.com/snapshot-checkpoint-status",
    "ANNOTATION_RESTORE_STATUS": "nvidia.com/snapshot-restore-status",
    "ANNOTATION_CHECKPOINT_LOCATION": "nvidia.com/snapshot-checkpoint-location",
    "ANNOTATION_CHECKPOINT_STORAGE_TYPE": "nvidia.com/snapshot-checkpoint-storage-type",
    "ANNOTATION_RESTORE_CONTAINER_ID": "nvidia.com/snapshot-restore-container-id",
    "CONTROL_VOLUME_NAME": "snapshot-control",
    "CONTROL_MOUNT_PATH": "/snapshot-control",
    "ENV_CONTROL_DIR": "SNAPSHOT_CONTROL_DIR",
    "ENV_CONTROL_DIR_LEGACY": "DYN_SNAPSHOT_CONTROL_DIR",
    "FILE_READY_FOR_CHECKPOINT": "ready-for-checkpoint",
    "FILE_READY_FOR_SNAPSHOT": "ready-for-snapshot",
    "FILE_RESTORE_CONTEXT": "restore-context.json",
    "ENV_RESTORE_STANDBY": "SNAPSHOT_RESTORE_STANDBY",
    "ENV_RESTORE_STANDBY_DYNAMO": "DYN_SNAPSHOT_RESTORE_STANDBY",
    "FILE_RESTORE_COMPLETE": "restore-complete",
    "FILE_SNAPSHOT_COMPLETE": "snapshot-complete",
    "LABEL_GPU_PRODUCT": "nvidia.com/gpu.product",
    "LABEL_GPU_COUNT": "nvidia.com/gpu.count",
    "LABEL_CUDA_DRIVER_MAJOR": "nvidia.com/cuda.driver.major",
    "LABEL_GPU_PRESENT": "nvidia.com/gpu.present",
    "RESOURCE_GPU": "nvidia.com/gpu",
    # NVIDIA Snapshot's restore-pod contract (api/podcontract at 0e66e97).
    "ANNOTATION_RESTORE_CONTAINER_MAP": "nvidia.com/restore-container-map",
    "ANNOTATION_SKIP_COMPAT_CHECK": "nvidia.com/snapshot-skip-compat-check",
    "ANNOTATION_RESTORED_CONTAINER_IDS": "nvidia.com/restored-container-ids",
    "POD_CONDITION_RESTORED": "nvidia.com/Restored",
}

QUALIFIED_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


@pytest.mark.parametrize(("name", "value"), sorted(DYNAMO_SPELLINGS.items()))
def test_spelling(name: str, value: str) -> None:
    assert getattr(protocol, name) == value


def test_protocol_version_and_finalizer() -> None:
    # 2: ready-for-snapshot (Dynamo >= 1.3) beside ready-for-checkpoint, restore-context.json, standby.
    assert protocol.PROTOCOL_VERSION == "2"
    assert protocol.FILES_READY == ("ready-for-snapshot", "ready-for-checkpoint")
    assert protocol.FINALIZER == "snapshot.nvidia.com/finalizer"
    assert protocol.ENV_CONTROL_DIRS == ("SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")


def test_every_exported_name_exists_and_label_keys_are_valid() -> None:
    for name in protocol.__all__:
        value = getattr(protocol, name)
        if name.startswith(("LABEL_", "ANNOTATION_")) or name == "FINALIZER":
            assert QUALIFIED_KEY.match(value), f"{name}={value!r} is not a valid label/annotation key"


def test_label_and_annotation_keys_are_distinct() -> None:
    keys = [getattr(protocol, n) for n in protocol.__all__ if n.startswith(("LABEL_", "ANNOTATION_"))]
    assert len(keys) == len(set(keys))


def test_per_container_keys() -> None:
    key = per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
    assert key == "nvidia.com/snapshot-restore-status.main"
    assert QUALIFIED_KEY.match(key)
    longest = "c" * (63 - len("snapshot-checkpoint-timings."))
    assert QUALIFIED_KEY.match(per_container(protocol.ANNOTATION_CHECKPOINT_TIMINGS, longest))


@pytest.mark.parametrize("container", ["c" * 60, "", "bad/slash", "trailing."])
def test_per_container_refuses_keys_the_apiserver_would_reject(container: str) -> None:
    with pytest.raises(ValueError, match="annotation key"):
        per_container(protocol.ANNOTATION_RESTORE_STATUS, container)


def test_status_values() -> None:
    assert [status.value for status in SnapshotStatus] == ["pending", "running", "completed", "failed"]
    assert SnapshotStatus.parse("completed") is SnapshotStatus.COMPLETED
    assert SnapshotStatus.parse("in_progress") is SnapshotStatus.RUNNING
    assert [status.terminal for status in SnapshotStatus] == [False, False, True, True]
    with pytest.raises(ValueError, match="done"):
        SnapshotStatus.parse("done")
