"""Whether the install mode fits the cluster: read once at start, from the DynamoGraphDeployment CRD.

Mode standalone runs the DGDs, which takes this project's CRD; mode dynamo-operator leaves them to NVIDIA's
Dynamo operator, which takes the operator's CRD. A controller that guessed wrong would create a second set
of pods for every DGD, or wait for DGDs no one creates: it refuses to start instead, saying which setting
to change.

Recent Dynamo operators also define and run DynamoCheckpoints, PodSnapshots and PodSnapshotContents (and
shape restore-from pods). In mode dynamo-operator every such kind whose CRD is not this project's is left
to its owner: this controller does not reconcile it (``kinds_left_to_others``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, ObjectView
from dynamo_snapshot.controller.config import InstallMode
from dynamo_snapshot.kube import ApiError, Kube, ResourceKind, is_not_found
from dynamo_snapshot.kube.dgd_versions import DgdVersion, read_version
from dynamo_snapshot.kube.kinds import CHECKPOINT, CRD, DGD, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SNAPSHOT_JOB

__all__ = [
    "DGD_CRD_NAME",
    "OPERATOR_DGD_VERSIONS",
    "SHARED_KINDS",
    "UNDERSTOOD_DGD_VERSIONS",
    "InstallModeRefused",
    "check_install_mode",
    "crd_name",
    "install_mode_problem",
    "kinds_left_to_others",
    "understood_dgd_versions",
]

log = logging.getLogger(__name__)

DGD_CRD_NAME: Final = f"{DGD.plural}.{DGD.group}"
# Kinds another operator may define and run beside ours (ai-dynamo/dynamo deploy/operator/config/crd/bases
# holds DynamoCheckpoint, PodSnapshot and PodSnapshotContent; ai-dynamo/snapshot adds SnapshotJob).
SHARED_KINDS: Final = (CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SNAPSHOT_JOB)
# The DGD versions this controller reads and writes, in either mode: v1beta1 where the CRD serves it (this
# project's CRD stores it, as Dynamo 1.5+'s does), else v1alpha1 (the older operators' CRDs); either is
# converted in-process to the shape the reconcilers read (kube/dgd_versions.py).
UNDERSTOOD_DGD_VERSIONS: Final = frozenset({DGD.version, protocol.API_VERSION_V1BETA1})
OPERATOR_DGD_VERSIONS: Final = UNDERSTOOD_DGD_VERSIONS
_OWNER_LABEL: Final = f"{protocol.LABEL_CRD_OWNER}={protocol.MANAGED_BY_VALUE}"
_SET_MODE: Final = "(Helm value mode, or the controller's --mode / config key mode)"


class InstallModeRefused(Exception):
    """The install mode contradicts the cluster; the message says what to change."""


def _is_ours(crd: Mapping[str, Any]) -> bool:
    return bool(Meta(crd).labels.get(protocol.LABEL_CRD_OWNER) == protocol.MANAGED_BY_VALUE)


def _served_versions(crd: Mapping[str, Any]) -> list[str]:
    versions = ObjectView(crd).spec.get("versions") or []
    return [str(v.get("name")) for v in versions if v.get("served")]


def install_mode_problem(crd: Mapping[str, Any] | None, mode: InstallMode) -> str | None:
    """Why ``mode`` cannot run with this DGD CRD (None: the cluster has none); None when it can."""
    if crd is None:
        if mode is InstallMode.DYNAMO_OPERATOR:
            return (
                f"mode {mode} runs beside NVIDIA's Dynamo operator, but the cluster has no "
                f"DynamoGraphDeployment CRD ({DGD_CRD_NAME}): install the Dynamo operator first, or set "
                f"mode {InstallMode.STANDALONE} {_SET_MODE} to install and run dynamo-snapshot's own"
            )
        return (
            f"mode {mode} runs the DynamoGraphDeployments, but the cluster has no DynamoGraphDeployment "
            f"CRD ({DGD_CRD_NAME}): install the dynamo-snapshot chart with mode {mode} (it installs the "
            "CRD), or kubectl apply -f crds/"
        )
    ours = _is_ours(crd)
    if mode is InstallMode.STANDALONE and not ours:
        return (
            f"mode {mode} creates the worker pods of every DynamoGraphDeployment, but the CRD {DGD_CRD_NAME} "
            f"is not dynamo-snapshot's (no label {_OWNER_LABEL}; NVIDIA's Dynamo operator installs one of "
            "this name), so another operator runs these DGDs: set mode "
            f"{InstallMode.DYNAMO_OPERATOR} {_SET_MODE}. If an older dynamo-snapshot chart installed it "
            f"(those CRDs carry no such label), label it: kubectl label crd {DGD_CRD_NAME} {_OWNER_LABEL}"
        )
    if mode is InstallMode.DYNAMO_OPERATOR and ours:
        return (
            f"mode {mode} leaves the DynamoGraphDeployments to NVIDIA's Dynamo operator, but the CRD "
            f"{DGD_CRD_NAME} is dynamo-snapshot's own (label {_OWNER_LABEL}), not the operator's: set "
            f"mode {InstallMode.STANDALONE} {_SET_MODE}"
        )
    served = _served_versions(crd)
    understood = understood_dgd_versions(mode)
    if not understood.intersection(served):
        owner = "dynamo-snapshot's" if ours else "another operator's"
        readable = " or ".join(sorted(understood))
        return (
            f"the CRD {DGD_CRD_NAME} ({owner}) serves "
            f"{', '.join(served) if served else 'no version'}, and this controller reads only "
            f"{readable}: install a Dynamo operator whose CRD serves {readable}, or a dynamo-snapshot "
            f"release that reads {' or '.join(served) if served else 'it'}"
        )
    return None


def understood_dgd_versions(mode: InstallMode) -> frozenset[str]:
    """The DGD versions this controller can read in ``mode``."""
    return OPERATOR_DGD_VERSIONS if mode is InstallMode.DYNAMO_OPERATOR else UNDERSTOOD_DGD_VERSIONS


def crd_name(kind: ResourceKind) -> str:
    return f"{kind.plural}.{kind.group}"


async def _read_crd(kube: Kube, name: str, mode: InstallMode) -> Mapping[str, Any] | None:
    """The CRD ``name`` (None: not installed); InstallModeRefused (logged) when it cannot be read."""
    try:
        crd: Mapping[str, Any] = await kube.get(CRD, name)
    except ApiError as e:
        if is_not_found(e):
            return None
        unreadable = (
            f"cannot read the CRD {name} to check mode {mode}: {e}. The controller needs get "
            f"on customresourcedefinitions/{name} (the chart's ClusterRole grants it)"
        )
        log.error("install mode check failed", extra={"mode": str(mode), "reason": unreadable})
        raise InstallModeRefused(unreadable) from None
    return crd


async def kinds_left_to_others(kube: Kube, mode: InstallMode) -> frozenset[str]:
    """In mode dynamo-operator, the SHARED_KINDS whose CRD is installed and not this project's: another
    operator runs their objects, so this controller does not reconcile them (and, for PodSnapshot, its
    restore webhook lets restore-from pods pass unchanged). None in mode standalone."""
    if mode is not InstallMode.DYNAMO_OPERATOR:
        return frozenset()
    left = set()
    for kind in SHARED_KINDS:
        crd = await _read_crd(kube, crd_name(kind), mode)
        if crd is not None and not _is_ours(crd):
            left.add(kind.kind)
            log.info("kind left to its CRD's owner", extra={"kind": kind.kind, "crd": crd_name(kind)})
    return frozenset(left)


async def check_install_mode(kube: Kube, mode: InstallMode) -> DgdVersion:
    """Read the DGD CRD and raise InstallModeRefused (logged) when ``mode`` contradicts it; else the version
    DGDs are read and written at."""
    crd = await _read_crd(kube, DGD_CRD_NAME, mode)
    problem = install_mode_problem(crd, mode)
    if problem:
        log.error("install mode refused", extra={"mode": str(mode), "reason": problem})
        raise InstallModeRefused(problem)
    versions = _served_versions(crd) if crd is not None else []
    chosen = DgdVersion(read_version(crd) or protocol.API_VERSION_V1BETA1)
    log.info(
        "install mode checked",
        extra={"mode": str(mode), "dgdCrdVersions": versions, "dgdVersion": chosen.version},
    )
    return chosen
