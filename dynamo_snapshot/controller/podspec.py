"""Pod, Job and SnapshotJob manifests the controller creates: for a DGD service, cold-start workers and
restore workers; for a DynamoCheckpoint, the SnapshotJob that takes it; for a SnapshotJob, the Job that runs
its pod to be captured. Pure functions over plain
dicts, so the reconcilers stay small and this stays testable.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility, DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, ServiceSpec
from dynamo_snapshot.api.podsnapshot import PodSnapshotCompatibility
from dynamo_snapshot.api.views import Meta, PodView, SnapshotJobView

Obj = dict[str, Any]

MAIN_CONTAINER = protocol.DEFAULT_TARGET_CONTAINER
# Kubernetes names are at most 63 characters in labels and 253 for pods; keep the prefix short enough
# that the random suffix always fits in a DNS label.
_PREFIX_MAX = 63 - 6


def owner_reference(obj: Obj, *, controller: bool = True) -> Obj:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": Meta(obj).name,
        "uid": Meta(obj).uid,
        "controller": controller,
        "blockOwnerDeletion": controller,
    }


def pod_name_prefix(graph: str, service: str) -> str:
    return f"{graph}-{service}".lower()[:_PREFIX_MAX].rstrip("-")


def new_pod_name(graph: str, service: str) -> str:
    return f"{pod_name_prefix(graph, service)}-{secrets.token_hex(2)}{secrets.choice('abcdefghjk')}"


def _env_list(*sources: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Merge EnvVar lists; later sources win by name, as Dynamo's service envs override graph envs."""
    merged: dict[str, dict[str, Any]] = {}
    for src in sources:
        for env in src or []:
            merged[env["name"]] = env
    return list(merged.values())


def _resources(service: ServiceSpec) -> dict[str, Any]:
    """The main container's requests and limits: Dynamo's cpu/memory/gpu/gpuType/custom and any Kubernetes
    resource named as such (nvidia.com/gpu: "1"), GPUs given only as requests given as limits too."""
    if service.resources is None:
        return {}
    # Validating the model already refused what a pod would be refused for (fractional or twice-given
    # GPUs, a request above its limit), so this does not raise for a model read from the apiserver.
    return service.resources.container_resources()


def gpus_of_pod(pod: Obj) -> int:
    """GPUs a pod asks for (limits, else requests) across its containers."""
    total = 0
    for c in PodView(pod).containers:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(protocol.RESOURCE_GPU) or (res.get("requests") or {}).get(
            protocol.RESOURCE_GPU
        )
        total += int(value) if value else 0
    return total


# Dynamo's operator gives a main container without `command` one (deploy/operator/internal/dynamo:
# component_frontend.go, component_common.go); upstream manifests rely on it, so the same pod runs here.
FRONTEND_COMMAND = ["python3"]
FRONTEND_ARGS = ["-m", "dynamo.frontend"]
SHELL_COMMAND = ["/bin/sh", "-c"]


def _default_command(service: ServiceSpec, main: Obj) -> None:
    """Fill in the command Dynamo's operator would run: `python3 -m dynamo.frontend` for a frontend,
    and `/bin/sh -c` for any other container given only `args` (Dynamo's older manifests put a shell
    pipeline there). A container with neither keeps its image's entrypoint."""
    if main.get("command"):
        return
    if (service.component_type or "").lower() == "frontend":
        main["command"] = list(FRONTEND_COMMAND)
        if not main.get("args"):
            main["args"] = list(FRONTEND_ARGS)
    elif main.get("args"):
        main["command"] = list(SHELL_COMMAND)


def unsupported(service: ServiceSpec) -> str | None:
    """Why the controller cannot run `service` as pods of its own (one pod per replica), else None."""
    multinode = (service.model_extra or {}).get("multinode")
    if multinode is None:
        return None
    # Dynamo's default node count is 2: a multinode block without one still spans two nodes.
    nodes = multinode.get("nodeCount", 2) if isinstance(multinode, dict) else multinode
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes <= 1:
        return None
    return (
        f"multinode.nodeCount is {nodes!r}: a replica spanning several nodes (a leader and its workers) "
        "is not something dynamo-snapshot runs (it runs one pod per replica); deploy this service with "
        "Dynamo's operator, or drop multinode"
    )


def worker_pod_spec(dgd: DynamoGraphDeployment, service_name: str, *, snapshot_control: bool = True) -> Obj:
    """The PodSpec of one worker of `service_name`.

    `snapshot_control` adds the control volume and env. Only checkpoint sources and restore targets get
    them: a worker that finds a control dir waits for `restore-complete`, which a cold start never gets.
    """
    service = (dgd.spec.services or {})[service_name]
    extra = (
        service.extra_pod_spec.model_dump(by_alias=True, exclude_unset=True) if service.extra_pod_spec else {}
    )
    main_override = extra.pop("mainContainer", None) or {}
    spec: Obj = copy.deepcopy(extra)
    main: Obj = {"name": MAIN_CONTAINER, **copy.deepcopy(main_override)}
    _default_command(service, main)
    main["env"] = _env_list(dgd.spec.envs, service.envs, main.get("env"))
    if service.env_from_secret:
        main.setdefault("envFrom", []).append({"secretRef": {"name": service.env_from_secret}})
    resources = _resources(service)
    if resources:
        main["resources"] = {**resources, **main.get("resources", {})}
    for probe, value in (
        ("readinessProbe", service.readiness_probe),
        ("livenessProbe", service.liveness_probe),
    ):
        if value is not None and probe not in main:
            main[probe] = copy.deepcopy(value)
    others = [c for c in spec.get("containers", []) if c.get("name") != MAIN_CONTAINER]
    spec["containers"] = [main, *others]
    if snapshot_control:
        add_snapshot_control(spec, MAIN_CONTAINER)
    return spec


def _container(spec: Obj, name: str) -> Obj:
    found: list[Obj] = [c for c in spec.get("containers") or [] if c.get("name") == name]
    if len(found) != 1:
        raise ValueError(f"the pod has no container {name!r}")
    return found[0]


def add_snapshot_control(spec: Obj, container: str) -> None:
    """Give ``container`` the snapshot control directory (an emptyDir the node agent reaches through the
    container's mount) and the variables that name it. Idempotent; raises ValueError without the container.

    The container sees its own subdirectory of the volume (subPath: its name), as the snapshot project's
    pod contract asks: containers of one pod that each take a restore keep their sentinels apart."""
    target = _container(spec, container)
    control_env = [{"name": n, "value": protocol.CONTROL_MOUNT_PATH} for n in protocol.ENV_CONTROL_DIRS]
    target["env"] = _env_list(target.get("env"), control_env)
    mounts = [m for m in target.get("volumeMounts") or [] if m.get("name") != protocol.CONTROL_VOLUME_NAME]
    target["volumeMounts"] = [
        *mounts,
        {
            "name": protocol.CONTROL_VOLUME_NAME,
            "mountPath": protocol.CONTROL_MOUNT_PATH,
            "subPath": container,
        },
    ]
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != protocol.CONTROL_VOLUME_NAME]
    spec["volumes"] = [*volumes, {"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}}]


def add_restore_standby(spec: Obj, container: str) -> None:
    """Tell ``container``'s entrypoint to wait as the placeholder a restore goes into, instead of
    cold-starting the worker (on a kubelet node the image's entrypoint always starts first). Idempotent."""
    target = _container(spec, container)
    standby = [{"name": n, "value": "1"} for n in protocol.ENV_RESTORE_STANDBYS]
    target["env"] = _env_list(target.get("env"), standby)


def _dgd_name(dgd: DynamoGraphDeployment) -> str:
    # Objects read from the apiserver always have a name; the model allows None only for manifests.
    return dgd.metadata.name or ""


def _base_labels(dgd: DynamoGraphDeployment, service_name: str) -> dict[str, str]:
    return {
        **(dgd.spec.labels or {}),
        **((dgd.spec.services or {})[service_name].labels or {}),
        protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
        protocol.LABEL_GRAPH: _dgd_name(dgd),
        protocol.LABEL_SERVICE: service_name,
    }


def cold_start_pod(
    dgd_obj: Obj,
    dgd: DynamoGraphDeployment,
    service_name: str,
    *,
    name: str | None = None,
    replaces: str | None = None,
) -> Obj:
    labels = {**_base_labels(dgd, service_name), protocol.LABEL_START_MODE: protocol.StartMode.COLD.value}
    annotations = dict((dgd.spec.services or {})[service_name].annotations or {})
    if replaces:
        annotations[protocol.ANNOTATION_REPLACES] = replaces
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name or new_pod_name(_dgd_name(dgd), service_name),
            "namespace": dgd.metadata.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(dgd_obj)],
        },
        "spec": worker_pod_spec(dgd, service_name, snapshot_control=False),
    }


def compatibility_affinity(compat: CheckpointCompatibility | PodSnapshotCompatibility | None) -> list[Obj]:
    """Node-selector requirements that place a restore only where the checkpoint's GPU state fits."""
    if compat is None:
        return []
    exprs: list[Obj] = []
    if compat.gpu_product:
        exprs.append({"key": protocol.LABEL_GPU_PRODUCT, "operator": "In", "values": [compat.gpu_product]})
    if compat.cuda_driver_major:
        exprs.append(
            {"key": protocol.LABEL_CUDA_DRIVER_MAJOR, "operator": "In", "values": [compat.cuda_driver_major]}
        )
    if compat.gpu_count:
        exprs.append(
            {"key": protocol.LABEL_GPU_COUNT, "operator": "Gt", "values": [str(compat.gpu_count - 1)]}
        )
    return exprs


def require_node_affinity(spec: Obj, exprs: list[Obj]) -> None:
    """AND ``exprs`` into the pod's required node affinity."""
    if not exprs:
        return
    required = (
        spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []})
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({"matchExpressions": []})
    # Terms are ORed, so the compatibility requirements must be ANDed into every one of them.
    for term in terms:
        term.setdefault("matchExpressions", []).extend(copy.deepcopy(exprs))


HOSTNAME_LABEL = "kubernetes.io/hostname"


def keep_off_nodes(spec: Obj, nodes: list[str], *, required: bool) -> None:
    """Keep a pod off `nodes`: always (a node where its restore failed) or by preference (nodes that
    just lost workers, which may be failing in ways the node's status does not show yet)."""
    if not nodes:
        return
    expr = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(nodes)}
    if required:
        require_node_affinity(spec, [expr])
        return
    preferred = (
        spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    )
    preferred.append({"weight": 100, "preference": {"matchExpressions": [expr]}})


def restore_pod(
    dgd_obj: Obj,
    dgd: DynamoGraphDeployment,
    service_name: str,
    ckpt: DynamoCheckpoint,
    *,
    name: str | None = None,
    replaces: str | None = None,
) -> Obj:
    pod = cold_start_pod(dgd_obj, dgd, service_name, name=name, replaces=replaces)
    pod["spec"] = worker_pod_spec(dgd, service_name, snapshot_control=True)
    add_restore_standby(pod["spec"], MAIN_CONTAINER)
    status = ckpt.status
    labels = pod["metadata"]["labels"]
    labels[protocol.LABEL_START_MODE] = protocol.StartMode.RESTORE.value
    labels[protocol.LABEL_RESTORE_TARGET] = protocol.TRUE
    labels[protocol.LABEL_CHECKPOINT_ID] = ckpt.metadata.name
    if status and status.identity_hash:
        labels[protocol.LABEL_CHECKPOINT_HASH] = status.identity_hash
    ann = pod["metadata"]["annotations"]
    ann[protocol.ANNOTATION_RESTORE_FROM] = ckpt.metadata.name
    ann[protocol.ANNOTATION_TARGET_CONTAINERS] = MAIN_CONTAINER
    if status and status.location:
        ann[protocol.ANNOTATION_CHECKPOINT_LOCATION] = status.location
    require_node_affinity(pod["spec"], compatibility_affinity(status.compatibility if status else None))
    return pod


def checkpoint_job_template(dgd: DynamoGraphDeployment, service_name: str) -> Obj:
    """The PodTemplateSpec an Auto-mode DynamoCheckpoint gets: the service's own worker."""
    return {
        "metadata": {
            "labels": {
                k: v
                for k, v in _base_labels(dgd, service_name).items()
                if k not in (protocol.LABEL_GRAPH, protocol.LABEL_SERVICE)
            }
        },
        "spec": worker_pod_spec(dgd, service_name),
    }


def checkpoint_snapshot_job(ckpt_obj: Obj, ckpt: DynamoCheckpoint, identity_hash: str) -> Obj:
    """The SnapshotJob that takes a DynamoCheckpoint: it runs the checkpoint's pod template to readiness and
    captures its ``main`` container into a PodSnapshot. Controlled by the checkpoint, so deleting the
    checkpoint deletes it (and the PodSnapshot, which carries the same controller)."""
    name = ckpt.metadata.name or ""
    return {
        "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
        "kind": "SnapshotJob",
        "metadata": {
            "name": checkpoint_job_name(name),
            "namespace": ckpt.metadata.namespace,
            "labels": {
                protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
                protocol.LABEL_CHECKPOINT_ID: name,
                protocol.LABEL_CHECKPOINT_HASH: identity_hash,
            },
            "ownerReferences": [owner_reference(ckpt_obj)],
        },
        "spec": {
            "podTemplate": copy.deepcopy(ckpt.spec.job.pod_template_spec),
            "activeDeadlineSeconds": ckpt.spec.job.active_deadline_seconds,
            "podSnapshotTemplate": {"targetContainers": [MAIN_CONTAINER]},
        },
    }


# Auto-mode checkpoint names: <dgd prefix>-<16 hex identity hash>-<8 hex of the DGD's uid>, at most this
# long so that "<name>-checkpoint" (the SnapshotJob, and a label value on its pod) stays a 63-character
# label.
AUTO_CHECKPOINT_NAME_MAX = 52


def auto_checkpoint_name(dgd_name: str, identity_hash: str, dgd_uid: str) -> str:
    """The name of a DGD's own Auto-mode checkpoint: readable, and unique per DGD and identity."""
    suffix = f"-{identity_hash}-{dgd_uid.replace('-', '')[:8]}"
    prefix = dgd_name[: AUTO_CHECKPOINT_NAME_MAX - len(suffix)].rstrip("-.")
    return f"{prefix}{suffix}" if prefix else suffix.lstrip("-")


def checkpoint_job_name(checkpoint_name: str) -> str:
    return f"{checkpoint_name}-checkpoint"[:63].rstrip("-")


# The node agent captures a SnapshotJob's pod once this file says the workload is ready; the pod's
# readiness probe reads it, so the Job's pod turns Ready exactly when it may be captured.
SNAPSHOT_READINESS_PROBE: Obj = {
    "exec": {"command": ["cat", f"{protocol.CONTROL_MOUNT_PATH}/{protocol.FILE_READY_FOR_SNAPSHOT}"]},
    "periodSeconds": 1,
}


def snapshot_job_labels(name: str, uid: str) -> dict[str, str]:
    """What a SnapshotJob's Job, pod and PodSnapshot carry: the SnapshotJob's name and UID."""
    return {
        protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
        protocol.LABEL_SNAPSHOT_JOB: name,
        protocol.LABEL_SNAPSHOT_JOB_UID: uid,
    }


def snapshot_job_source(sj_obj: Obj, target: str, active_deadline_seconds: int) -> Obj:
    """The batch/v1 Job that runs a SnapshotJob's pod template until the node agent captures ``target``.

    The Job has the SnapshotJob's name, and the SnapshotJob as controller; it runs one pod once
    (backoffLimit 0, restartPolicy Never). ``target`` gets the control directory and a readiness probe on
    ``ready-for-snapshot`` instead of its own probes: no liveness or startup probe may kill it while it is
    quiesced for the capture. Raises ValueError when the template has no container ``target``.
    """
    meta = Meta(sj_obj)
    labels = snapshot_job_labels(meta.name, meta.uid)
    template = copy.deepcopy(SnapshotJobView(sj_obj).pod_template)
    template_meta = template.get("metadata") or {}
    # The pod names its captured container itself, for the node agent's reports on it.
    annotations = {**(template_meta.get("annotations") or {}), protocol.ANNOTATION_TARGET_CONTAINERS: target}
    template["metadata"] = {
        **template_meta,
        "labels": {**(template_meta.get("labels") or {}), **labels},
        "annotations": annotations,
    }
    spec = template.setdefault("spec", {})
    spec["restartPolicy"] = "Never"
    add_snapshot_control(spec, target)
    container = _container(spec, target)
    container["readinessProbe"] = copy.deepcopy(SNAPSHOT_READINESS_PROBE)
    container.pop("livenessProbe", None)
    container.pop("startupProbe", None)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(sj_obj)],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": active_deadline_seconds,
            "template": template,
        },
    }
