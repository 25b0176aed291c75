"""Every name the controller, the node agent and the workload use to talk to each other.

This is the one place these strings are spelled; import them from here.  Where NVIDIA Dynamo's own
snapshot code already has a name for the same thing (ai-dynamo/dynamo deploy/snapshot, and the
snapshotprotocol package of its operator), the spelling is Dynamo's, so pods and checkpoints stay
readable by Dynamo's tooling.  Bump ``PROTOCOL_VERSION`` whenever a name or meaning here changes in a
way an older agent or workload would misread.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

__all__ = [
    "ANNOTATION_ARTIFACT_VERSION",
    "ANNOTATION_AVOID_NODES",
    "ANNOTATION_CHECKPOINT_LOCATION",
    "ANNOTATION_CHECKPOINT_STATUS",
    "ANNOTATION_CHECKPOINT_STORAGE_TYPE",
    "ANNOTATION_CHECKPOINT_TIMINGS",
    "ANNOTATION_CONTENT_ARTIFACT",
    "ANNOTATION_CONTENT_COMPATIBILITY",
    "ANNOTATION_DGD_SPEC",
    "ANNOTATION_DGD_STATUS",
    "ANNOTATION_DYNAMO_CHECKPOINT_NAME",
    "ANNOTATION_DYNAMO_RESTORE_CANDIDATE",
    "ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND",
    "ANNOTATION_REPLACES",
    "ANNOTATION_RESTORED_CONTAINER_IDS",
    "ANNOTATION_RESTORE_ATTEMPTS",
    "ANNOTATION_RESTORE_CONTAINER_ID",
    "ANNOTATION_RESTORE_CONTAINER_MAP",
    "ANNOTATION_RESTORE_FROM",
    "ANNOTATION_RESTORE_MESSAGE",
    "ANNOTATION_RESTORE_STATUS",
    "ANNOTATION_RESTORE_TIMINGS",
    "ANNOTATION_SKIP_COMPAT_CHECK",
    "ANNOTATION_TARGET_CONTAINERS",
    "ANNOTATION_WORKLOAD_EXITED",
    "API_GROUP",
    "API_VERSION",
    "API_VERSION_V1BETA1",
    "ARTIFACT_WEIGHTS_DIR",
    "CONTROL_MOUNT_PATH",
    "CONTROL_VOLUME_NAME",
    "DEFAULT_TARGET_CONTAINER",
    "ENV_CONTROL_DIR",
    "ENV_CONTROL_DIRS",
    "ENV_CONTROL_DIR_LEGACY",
    "ENV_RESTORE_STANDBY",
    "ENV_RESTORE_STANDBYS",
    "ENV_RESTORE_STANDBY_DYNAMO",
    "FEATURE_RELEASE_ZERO_PAGES",
    "FEATURE_RESTORE_COMPLETE_LINES",
    "FILES_READY",
    "FILE_READY_FOR_CHECKPOINT",
    "FILE_READY_FOR_SNAPSHOT",
    "FILE_RESTORE_COMPLETE",
    "FILE_RESTORE_CONTEXT",
    "FILE_RESTORE_FAILED",
    "FILE_RESTORE_STANDBY",
    "FILE_SNAPSHOT_COMPLETE",
    "FILE_WEIGHTS_ARRIVED",
    "FILE_WEIGHTS_MANIFEST",
    "FILE_WEIGHTS_VERIFIED",
    "FILE_ZERO_PAGES_RELEASED",
    "FILE_ZERO_PAGES_REQUEST",
    "FINALIZER",
    "FINALIZER_CONTENT_CLEANUP",
    "LABEL_CAPTURE_ELIGIBLE",
    "LABEL_CHECKPOINT_HASH",
    "LABEL_CHECKPOINT_ID",
    "LABEL_CHECKPOINT_SOURCE",
    "LABEL_CRD_OWNER",
    "LABEL_CUDA_DRIVER_MAJOR",
    "LABEL_DYNAMO_COMPONENT",
    "LABEL_DYNAMO_GRAPH",
    "LABEL_GPU_COUNT",
    "LABEL_GPU_PRESENT",
    "LABEL_GPU_PRODUCT",
    "LABEL_GRAPH",
    "LABEL_MANAGED_BY",
    "LABEL_RESTORE_TARGET",
    "LABEL_SERVICE",
    "LABEL_SNAPSHOT_JOB",
    "LABEL_SNAPSHOT_JOB_UID",
    "LABEL_SNAPSHOT_NODE",
    "LABEL_START_MODE",
    "MANAGED_BY_VALUE",
    "POD_CONDITION_RESTORED",
    "PROTOCOL_VERSION",
    "READY_FEATURES",
    "RESOURCE_GPU",
    "RESTORE_ATTEMPTS_MAX",
    "RESTORE_COMPLETE_DOC_KEY",
    "RESTORE_COMPLETE_PID_KEY",
    "RESTORE_CONTEXT_ENV_NAMES",
    "RESTORE_WEIGHTS_ARRIVING",
    "RESTORE_WEIGHTS_CHECK",
    "TRUE",
    "WEIGHTS_CHECK_PENDING",
    "RestoredReason",
    "SnapshotStatus",
    "StartMode",
    "per_container",
]

PROTOCOL_VERSION: Final = "2"

API_GROUP: Final = "nvidia.com"
API_VERSION: Final = "v1alpha1"
# DynamoGraphDeployment only: Dynamo's newer version, converted to and from API_VERSION losslessly.
API_VERSION_V1BETA1: Final = "v1beta1"
# On a converted DynamoGraphDeployment, Dynamo's spellings: what the other version has and this one
# cannot hold, as JSON (dgd_conversion).  Reserved: conversion consumes them.
ANNOTATION_DGD_SPEC: Final = "nvidia.com/dgd-spec"
ANNOTATION_DGD_STATUS: Final = "nvidia.com/dgd-status"

# Label values that are flags are the string "true": label values cannot be booleans.
TRUE: Final = "true"

# --- Pod labels (selectors for the controller's and agent's watches) -------------------------------
LABEL_CHECKPOINT_HASH: Final = "nvidia.com/snapshot-checkpoint-hash"
LABEL_CHECKPOINT_SOURCE: Final = "nvidia.com/snapshot-is-checkpoint-source"
LABEL_CHECKPOINT_ID: Final = "nvidia.com/snapshot-checkpoint-id"
LABEL_RESTORE_TARGET: Final = "nvidia.com/snapshot-is-restore-target"

# --- Labels the controller puts on everything it creates (its informers select on them) -----------
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "dynamo-snapshot"
# The DynamoGraphDeployment and service a worker pod belongs to.
LABEL_GRAPH: Final = "snapshot.nvidia.com/graph"
LABEL_SERVICE: Final = "snapshot.nvidia.com/service"
# How a worker pod starts: see StartMode.
LABEL_START_MODE: Final = "snapshot.nvidia.com/start-mode"
# On the CustomResourceDefinitions this project generates, with MANAGED_BY_VALUE: a CRD of the same name
# without it (NVIDIA's Dynamo operator's DynamoGraphDeployment) is someone else's.
LABEL_CRD_OWNER: Final = "snapshot.nvidia.com/crd-owner"

# --- Labels NVIDIA's Dynamo operator puts on a DGD's pods and scaling adapters (its consts package) ---
# The DynamoGraphDeployment's name and the service (v1beta1: component) name.
LABEL_DYNAMO_GRAPH: Final = "nvidia.com/dynamo-graph-deployment-name"
LABEL_DYNAMO_COMPONENT: Final = "nvidia.com/dynamo-component"
# On the pod templates of a checkpointed component: "true" while the operator's pod-create webhook is to
# shape new pods into restore pods from the checkpoint named by the second, of the kind the third names
# (PodSnapshot, or SnapshotJob while the capture is pending).
ANNOTATION_DYNAMO_RESTORE_CANDIDATE: Final = "nvidia.com/dynamo-checkpoint-restore-candidate"
ANNOTATION_DYNAMO_CHECKPOINT_NAME: Final = "nvidia.com/dynamo-checkpoint-name"
ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND: Final = "nvidia.com/dynamo-restore-source-kind"


class StartMode(StrEnum):
    """How a worker pod came to life; restore and cold start are counted apart in status and metrics."""

    COLD = "cold"
    RESTORE = "restore"


# --- Pod annotations -----------------------------------------------------------------------------
# Names what to restore into the pod: a DynamoCheckpoint of the pod's namespace, else a PodSnapshot there.
ANNOTATION_RESTORE_FROM: Final = "nvidia.com/restore-from"
# Comma-separated container names to checkpoint or restore; other containers are left alone.
ANNOTATION_TARGET_CONTAINERS: Final = "nvidia.com/snapshot-target-containers"
ANNOTATION_CHECKPOINT_LOCATION: Final = "nvidia.com/snapshot-checkpoint-location"
ANNOTATION_CHECKPOINT_STORAGE_TYPE: Final = "nvidia.com/snapshot-checkpoint-storage-type"

# Progress the node agent reports, one key per container: use per_container(...) for the full key.
ANNOTATION_CHECKPOINT_STATUS: Final = "nvidia.com/snapshot-checkpoint-status"
ANNOTATION_RESTORE_STATUS: Final = "nvidia.com/snapshot-restore-status"
ANNOTATION_RESTORE_MESSAGE: Final = "nvidia.com/snapshot-restore-message"
# JSON object of phase name -> seconds, for the startup-latency report.
ANNOTATION_CHECKPOINT_TIMINGS: Final = "nvidia.com/snapshot-checkpoint-timings"
ANNOTATION_RESTORE_TIMINGS: Final = "nvidia.com/snapshot-restore-timings"
# On a cold-start pod that replaces a failed restore: the failed pod's name (makes the swap idempotent).
ANNOTATION_REPLACES: Final = "snapshot.nvidia.com/replaces"
# The container ID a restore went into, so a restarted container is not mistaken for a restored one.
ANNOTATION_RESTORE_CONTAINER_ID: Final = "nvidia.com/snapshot-restore-container-id"
# Per container (per_container(...)): set by the node agent when a worker process it started or restored
# is gone while its pod still exists — what a kubelet reports as a terminated container, for workers no
# kubelet watches. The value says what the agent saw. The controller treats the pod as lost.
ANNOTATION_WORKLOAD_EXITED: Final = "nvidia.com/snapshot-workload-exited"
# On a restore pod that retries a failed restore: comma-separated nodes where this restore already
# failed; the pod's node affinity keeps it off them, and a further failure adds its node.
ANNOTATION_AVOID_NODES: Final = "snapshot.nvidia.com/avoid-nodes"
# On a restore pod, written by the node agent: how many times a restore into it was started. A restore
# cut short by an agent restart is started again (not counted against the checkpoint) until this reaches
# RESTORE_ATTEMPTS_MAX.
ANNOTATION_RESTORE_ATTEMPTS: Final = "nvidia.com/snapshot-restore-attempts"
RESTORE_ATTEMPTS_MAX: Final = 3


class SnapshotStatus(StrEnum):
    """Value of the per-container checkpoint and restore status annotations."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"

    @classmethod
    def parse(cls, value: str) -> SnapshotStatus:
        """Read a status annotation, including Dynamo's agent's spelling of a restore under way."""
        if value == "in_progress":
            return cls.RUNNING
        return cls(value)

    @property
    def terminal(self) -> bool:
        return self in (SnapshotStatus.COMPLETED, SnapshotStatus.FAILED)


# An annotation key's name part (after the '/') is a qualified name of at most 63 characters.
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def per_container(annotation: str, container: str) -> str:
    """The per-container form of a status annotation: ``<annotation>.<container>``.

    Raises ValueError when the key would not be a valid annotation key, which long container names
    can cause; the agent must then fail the operation rather than write somewhere nobody reads.
    """
    key = f"{annotation}.{container}"
    _, _, name = key.partition("/")
    if len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        raise ValueError(f"container name {container!r} gives an invalid annotation key {key!r}")
    return key


# --- The control volume shared by the workload and the node agent ----------------------------------
CONTROL_VOLUME_NAME: Final = "snapshot-control"
CONTROL_MOUNT_PATH: Final = "/snapshot-control"
ENV_CONTROL_DIR: Final = "SNAPSHOT_CONTROL_DIR"
# Dynamo's workers (dynamo.common.snapshot) still read this name.
ENV_CONTROL_DIR_LEGACY: Final = "DYN_SNAPSHOT_CONTROL_DIR"
# Pods get both, so old and new workloads find the directory.
ENV_CONTROL_DIRS: Final = (ENV_CONTROL_DIR, ENV_CONTROL_DIR_LEGACY)
# Set to "1" on a restore pod's main container on a kubelet node: the image's own entrypoint does not
# cold-start the worker but waits as the container's placeholder until the agent restores the
# checkpointed tree into the container (see FILE_RESTORE_STANDBY). Dynamo 1.6's workers read the first
# (dynamo.common.snapshot.restore_context), NVIDIA's snapshot operator sets the second; restore pods get
# both.
ENV_RESTORE_STANDBY: Final = "SNAPSHOT_RESTORE_STANDBY"
ENV_RESTORE_STANDBY_DYNAMO: Final = "DYN_SNAPSHOT_RESTORE_STANDBY"
ENV_RESTORE_STANDBYS: Final = (ENV_RESTORE_STANDBY, ENV_RESTORE_STANDBY_DYNAMO)

# Sentinel files in the control directory.
# Written by the workload once its engine is loaded and it is safe to checkpoint: Dynamo >= 1.3 and this
# SDK write the first (Dynamo's is the text "ready"), Dynamo <= 1.2.1 the second. The agent takes either.
FILE_READY_FOR_SNAPSHOT: Final = "ready-for-snapshot"
FILE_READY_FOR_CHECKPOINT: Final = "ready-for-checkpoint"
FILES_READY: Final = (FILE_READY_FOR_SNAPSHOT, FILE_READY_FOR_CHECKPOINT)
# Written by the agent once a restore has finished and the workload may resume. The restore-pod
# contract's content is "key=value" lines, among them the restored process's pid as its own PID namespace
# numbers it (readers ignore keys they do not know); this project's agent adds its JSON document (who the
# worker is now) under RESTORE_COMPLETE_DOC_KEY. It writes the lines for every worker but one whose ready
# file is this SDK's without FEATURE_RESTORE_COMPLETE_LINES: an SDK that reads only the JSON document,
# which it then gets alone.
FILE_RESTORE_COMPLETE: Final = "restore-complete"
RESTORE_COMPLETE_PID_KEY: Final = "pid"
RESTORE_COMPLETE_DOC_KEY: Final = "restore"
FEATURE_RESTORE_COMPLETE_LINES: Final = "restore-complete-lines"
# Written by the agent ({"message": why}) when a restore into the container failed, before it stops what
# the restore put there (the restore-pod contract's name): the failing container never acts on it; a
# later container of the same pod reads it as proof that the pod's one restore was used, and a standby
# placeholder (this SDK's) then exits saying so instead of waiting for a restore that will not come.
FILE_RESTORE_FAILED: Final = "restore-failed"
# Written by a standby placeholder (ENV_RESTORE_STANDBY) once it waits for the restore: the agent
# restores only into a container that says so (this file, or a Dynamo standby's FILE_RESTORE_CONTEXT),
# never over a worker that cold-started.
FILE_RESTORE_STANDBY: Final = "restore-standby"
# {"env": {NAME: value or null}}: the restore pod's values of RESTORE_CONTEXT_ENV_NAMES, which a Dynamo
# worker applies after restore-complete (and fails without). Written by the standby entrypoint (Dynamo's
# and this SDK's), else by the agent before restore-complete.
FILE_RESTORE_CONTEXT: Final = "restore-context.json"
# The names Dynamo 1.6.1 carries across a restore (dynamo.common.snapshot.constants: the Kubernetes
# identity, the runtime's discovery/planes/endpoints, health settings, failover and platform endpoints).
RESTORE_CONTEXT_ENV_NAMES: Final = frozenset(
    {
        "DYN_NAMESPACE", "DYN_COMPONENT", "DYN_PARENT_DGD_K8S_NAME", "DYN_PARENT_DGD_K8S_NAMESPACE",
        "POD_NAME", "POD_NAMESPACE", "POD_UID", "DYN_NAMESPACE_WORKER_SUFFIX",
        "DYN_DISCOVERY_BACKEND", "DYN_REQUEST_PLANE", "DYN_EVENT_PLANE", "DYN_EVENT_PLANE_HOST",
        "DYN_TCP_RPC_HOST", "DYN_TCP_RPC_PORT", "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_TCP_RESPONSE_STREAM_PORT", "DYN_TCP_LISTEN_BACKLOG", "NATS_SERVER", "ETCD_ENDPOINTS",
        "DYN_SYSTEM_PORT", "DYN_HEALTH_CHECK_ENABLED", "DYN_SYSTEM_STARTING_HEALTH_STATUS",
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", "DYN_SYSTEM_HOST", "DYN_SYSTEM_HEALTH_PATH",
        "DYN_SYSTEM_LIVE_PATH", "DYN_KUBE_DISCOVERY_MODE", "CONTAINER_NAME", "ENGINE_ID",
        "FAILOVER_LOCK_PATH", "DYN_VLLM_GMS_SHADOW_MODE", "DYN_GMS_USE_V1", "MODEL_EXPRESS_URL",
        "PROMETHEUS_ENDPOINT",
    }
)  # fmt: skip
# Written by the agent after a successful dump; Dynamo workloads that survive a dump wait for it.
FILE_SNAPSHOT_COMPLETE: Final = "snapshot-complete"
# Written by the workload SDK before ready-for-checkpoint when it took GPU memory out of the checkpoint:
# the weights files to carry in the artifact, and the bytes it maps again after a restore.
FILE_WEIGHTS_MANIFEST: Final = "weights.json"
# Written by the agent once the weights files it carried passed their checksums. A workload whose
# weights manifest says it waits for this (`waits_for_weights_check`) may get restore-complete while the
# check still runs, marked {RESTORE_WEIGHTS_CHECK: WEIGHTS_CHECK_PENDING}: it may load its weights then
# (its reads and the agent's share the page cache) but must not serve before this file exists. A
# failed check ends with the agent stopping the workload instead.
FILE_WEIGHTS_VERIFIED: Final = "weights-verified"
RESTORE_WEIGHTS_CHECK: Final = "weightsCheck"
WEIGHTS_CHECK_PENDING: Final = "pending"
# Written (and replaced, atomically) by the agent while the weights files it put back still arrive from
# the object store, for a workload whose weights manifest says it reads them so
# (`reads_arriving_weights`): restore-complete then also says {RESTORE_WEIGHTS_ARRIVING: true}, and this
# file's {"version": 1, "files": {path as the workload recorded it: bytes}} says how much of each file,
# from its start, is in and checked. The workload reads no byte beyond that; every file is whole once
# FILE_WEIGHTS_VERIFIED exists.
FILE_WEIGHTS_ARRIVED: Final = "weights-arrived"
RESTORE_WEIGHTS_ARRIVING: Final = "weightsArriving"
# Inside an artifact: where the agent keeps the weights files the manifest above named.
ARTIFACT_WEIGHTS_DIR: Final = "weights"
# The zero pages of the CUDA checkpoint's host copy, given back by the workload itself before CRIU dumps
# it (only a process may drop its own pages). A workload that can do it lists this feature under
# READY_FEATURES in its ready-for-snapshot JSON; after the CUDA checkpoint the agent writes
# FILE_ZERO_PAGES_REQUEST ({"pid": the workload's pid as it sees it, "ranges": [[start, end], ...], the
# mappings the driver made during the checkpoint}) and waits a bounded time for FILE_ZERO_PAGES_RELEASED
# (ZeroPagesReleased); without an answer the dump simply holds the zeros.
READY_FEATURES: Final = "features"
FEATURE_RELEASE_ZERO_PAGES: Final = "release-zero-pages"
FILE_ZERO_PAGES_REQUEST: Final = "release-zero-pages.json"
FILE_ZERO_PAGES_RELEASED: Final = "zero-pages-released.json"

# Held on DynamoCheckpoints by the controller until no restore from them is under way; once the object
# is gone, node agents remove its artifact.
FINALIZER: Final = "snapshot.nvidia.com/finalizer"

# --- The generic snapshot API (PodSnapshot, PodSnapshotContent, SnapshotJob), spelled as NVIDIA Snapshot's
# api/v1alpha1 spells it -------------------------------------------------------------------------------
# The container a checkpoint captures when nothing names one.
DEFAULT_TARGET_CONTAINER: Final = "main"
# On a PodSnapshotContent: the node whose agent captures it (agents select their own node's contents).
LABEL_SNAPSHOT_NODE: Final = "nvidia.com/snapshot-node"
# On a SnapshotJob's pod and the PodSnapshot it produces: the SnapshotJob's name and UID.
LABEL_SNAPSHOT_JOB: Final = "nvidia.com/snapshot-job"
LABEL_SNAPSHOT_JOB_UID: Final = "nvidia.com/snapshot-job-uid"
# On a source pod, by the node agent: it checked the pod and may capture it.
LABEL_CAPTURE_ELIGIBLE: Final = "nvidia.com/snapshot-capture-eligible"
# On a restore pod beside nvidia.com/restore-from: "source=destination,..." when the captured container
# goes into a container of another name (absent: the same name).
ANNOTATION_RESTORE_CONTAINER_MAP: Final = "nvidia.com/restore-container-map"
# On a source pod: the version directory of the artifact the capture writes.
ANNOTATION_ARTIFACT_VERSION: Final = "nvidia.com/snapshot-artifact-version"
# Held on a PodSnapshot until the PodSnapshotContent it bound is deleted.
FINALIZER_CONTENT_CLEANUP: Final = "nvidia.com/podsnapshotcontent-cleanup"
# On a PodSnapshotContent, written by the node agent before it says the capture is Ready: status.artifact
# and status.compatibility as JSON objects (the same fields). Another operator's CRD (NVIDIA Snapshot's)
# prunes those status fields; annotations of a cluster-scoped object are kept, and no tenant can write
# them. A restore reads the status fields where present, else these.
ANNOTATION_CONTENT_ARTIFACT: Final = "snapshot.nvidia.com/artifact"
ANNOTATION_CONTENT_COMPATIBILITY: Final = "snapshot.nvidia.com/compatibility"
# The pod condition a restore's outcome is written to; a pod may gate its readiness on it.
POD_CONDITION_RESTORED: Final = "nvidia.com/Restored"


class RestoredReason(StrEnum):
    """Reasons of the nvidia.com/Restored pod condition this project's agent writes, as NVIDIA Snapshot's
    restore-pod contract (api/podcontract) spells them; `api.restore_outcome` classifies them and the
    contract's others."""

    IN_PROGRESS = "RestoreInProgress"  # False
    SUCCEEDED = "RestoreSucceeded"  # True
    FAILED = "RestoreFailed"  # False
    PARTIALLY_SUCCEEDED = "RestorePartiallySucceeded"  # False
    # A destination of a fully restored pod whose container the kubelet replaced (it died) is being
    # restored again in place, its siblings left as they run.
    REPLENISHING = "RestoreReplenishing"  # False
    # Refused before anything was read: the node or the restore container cannot run the checkpoint
    # (ANNOTATION_SKIP_COMPAT_CHECK lets it be attempted anyway).
    INCOMPATIBLE = "RestoreIncompatible"  # False


# On a restore pod, by its creator: "true" (any spelling Go's strconv.ParseBool reads as true) has the
# node agent attempt a restore its compatibility checks refuse (another GPU product or driver, another
# image, too little free GPU memory). Added to a pod whose restore was refused as RestoreIncompatible,
# it reopens that restore in place. Never skipped by it: the authorization (a Ready checkpoint of the
# pod's own namespace), the artifact's digest and seal, and the GPUs the restore container was given.
ANNOTATION_SKIP_COMPAT_CHECK: Final = "nvidia.com/snapshot-skip-compat-check"
# On a restored pod, by the node agent alone: {"<container>": "<container ID>"} of the containers it
# restored into (a producer must not set or copy it).
ANNOTATION_RESTORED_CONTAINER_IDS: Final = "nvidia.com/restored-container-ids"


# --- GPU node labels (NVIDIA GPU feature discovery) and the device-plugin resource -----------------
LABEL_GPU_PRODUCT: Final = "nvidia.com/gpu.product"
LABEL_GPU_COUNT: Final = "nvidia.com/gpu.count"
LABEL_CUDA_DRIVER_MAJOR: Final = "nvidia.com/cuda.driver.major"
LABEL_GPU_PRESENT: Final = "nvidia.com/gpu.present"
RESOURCE_GPU: Final = "nvidia.com/gpu"
