"""Whether the install mode fits the cluster: read once at start, from the DynamoGraphDeployment CRD.

Mode standalone runs the DGDs, which takes this project's CRD; mode dynamo-operator leaves them to NVIDIA's
Dynamo operator, which takes the operator's CRD. A controller that guessed wrong would create a second set
of pods for every DGD, or wait for DGDs no one creates: it refuses to start instead, saying which setting
to change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import InstallMode
from dynamo_snapshot.kube import ApiError, Kube, ResourceKind, is_not_found
from dynamo_snapshot.kube.kinds import DGD

__all__ = [
    "CRD",
    "DGD_CRD_NAME",
    "UNDERSTOOD_DGD_VERSIONS",
    "InstallModeRefused",
    "check_install_mode",
    "install_mode_problem",
]

log = logging.getLogger(__name__)

CRD: Final = ResourceKind(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False
)
DGD_CRD_NAME: Final = f"{DGD.plural}.{DGD.group}"
# The DGD versions this controller reads and writes.
UNDERSTOOD_DGD_VERSIONS: Final = frozenset({DGD.version})
_OWNER_LABEL: Final = f"{protocol.LABEL_CRD_OWNER}={protocol.MANAGED_BY_VALUE}"
_SET_MODE: Final = "(Helm value mode, or the controller's --mode / config key mode)"


class InstallModeRefused(Exception):
    """The install mode contradicts the cluster; the message says what to change."""


def _is_ours(crd: Mapping[str, Any]) -> bool:
    labels = (crd.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(protocol.LABEL_CRD_OWNER) == protocol.MANAGED_BY_VALUE)


def _served_versions(crd: Mapping[str, Any]) -> list[str]:
    versions = (crd.get("spec") or {}).get("versions") or []
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
    if not UNDERSTOOD_DGD_VERSIONS.intersection(served):
        owner = "dynamo-snapshot's" if ours else "another operator's"
        return (
            f"the CRD {DGD_CRD_NAME} ({owner}) serves "
            f"{', '.join(served) if served else 'no version'}, and this controller reads only "
            f"{', '.join(sorted(UNDERSTOOD_DGD_VERSIONS))}: install a Dynamo operator whose CRD serves "
            f"{' or '.join(sorted(UNDERSTOOD_DGD_VERSIONS))}, or a dynamo-snapshot release that reads "
            f"{' or '.join(served) if served else 'it'}"
        )
    return None


async def check_install_mode(kube: Kube, mode: InstallMode) -> None:
    """Read the DGD CRD and raise InstallModeRefused (logged) when ``mode`` contradicts it."""
    try:
        crd: Mapping[str, Any] | None = await kube.get(CRD, DGD_CRD_NAME)
    except ApiError as e:
        if not is_not_found(e):
            unreadable = (
                f"cannot read the CRD {DGD_CRD_NAME} to check mode {mode}: {e}. The controller needs get "
                f"on customresourcedefinitions/{DGD_CRD_NAME} (the chart's ClusterRole grants it)"
            )
            log.error("install mode check failed", extra={"mode": str(mode), "reason": unreadable})
            raise InstallModeRefused(unreadable) from None
        crd = None
    problem = install_mode_problem(crd, mode)
    if problem:
        log.error("install mode refused", extra={"mode": str(mode), "reason": problem})
        raise InstallModeRefused(problem)
    versions = _served_versions(crd) if crd is not None else []
    log.info("install mode checked", extra={"mode": str(mode), "dgdCrdVersions": versions})
