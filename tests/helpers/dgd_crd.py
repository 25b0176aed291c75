"""The session cluster's DynamoGraphDeployment CRD swapped for another one of the same name (NVIDIA's Dynamo
operator's, one serving only a version we do not read) or removed, and put back after: the install modes
are about whose CRD that is.

Every swap is built by editing the generated CRD, so the apiserver keeps storing the DGDs other tests made;
the restore waits until v1alpha1 is served again.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from typing import Any

from dynamo_snapshot.api import crdgen, protocol
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.localcluster import LocalCluster
from tests.helpers.polling import wait_for

Obj = dict[str, Any]
DGD_CRD = "dynamographdeployments.nvidia.com"
UNKNOWN_VERSION = "v9alpha1"
# What NVIDIA's Dynamo platform chart puts on its CRD: Helm's ownership, none of ours.
OPERATOR_LABELS = {"app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/part-of": "dynamo-platform"}
OPERATOR_ANNOTATIONS = {
    "meta.helm.sh/release-name": "dynamo-platform",
    "meta.helm.sh/release-namespace": "dynamo-system",
}


def ours() -> Obj:
    """The DGD CRD as crds/ holds it."""
    return crdgen.build_crd(DynamoGraphDeployment)


def operators(crd: Obj | None = None) -> Obj:
    """``crd`` (default ours) as another operator's: its labels and annotations, not our ownership label."""
    out = copy.deepcopy(crd or ours())
    out["metadata"]["labels"] = dict(OPERATOR_LABELS)
    out["metadata"]["annotations"] = dict(OPERATOR_ANNOTATIONS)
    assert protocol.LABEL_CRD_OWNER not in out["metadata"]["labels"]
    return out


def serving_only_an_unknown_version(crd: Obj) -> Obj:
    """``crd`` serving only UNKNOWN_VERSION: v1alpha1 stays its storage version (the DGDs already stored
    keep their version, so restoring needs no migration) but is not served."""
    out = copy.deepcopy(crd)
    [known] = out["spec"]["versions"]
    unknown = {**copy.deepcopy(known), "name": UNKNOWN_VERSION, "served": True, "storage": False}
    known["served"] = False
    out["spec"]["versions"] = [known, unknown]
    return out


def _served(cluster: LocalCluster, version: str) -> bool:
    proc = cluster.kubectl(
        "get", f"dynamographdeployments.{version}.nvidia.com", "-A", "-o", "name", check=False
    )
    return proc.returncode == 0


@contextlib.contextmanager
def dgd_crd_as(cluster: LocalCluster, crd: Obj | None) -> Iterator[None]:
    """The cluster's DGD CRD is ``crd`` (None: there is none) inside the block; ours again after it."""
    if crd is None:
        cluster.kubectl("delete", "crd", DGD_CRD, "--ignore-not-found", "--wait=true", "--timeout=60s")
    else:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(crd))
    try:
        yield
    finally:
        if crd is None:
            # A Helm release may have made one meanwhile (and kept it): replaced too, it is ours again.
            cluster.install_crds()
        cluster.kubectl("replace", "-f", "-", input=json.dumps(ours()))
        wait_for(lambda: _served(cluster, "v1alpha1"), within=30, what="v1alpha1 DGDs served again")
