"""The session cluster's DynamoGraphDeployment CRD swapped for another one of the same name (NVIDIA's Dynamo
operator's, one serving only a version we do not read, the operator's serving v1beta1) or removed, and put
back after: the install modes are about whose CRD that is.

Every swap is built by editing a generated CRD, and lists (unserved) every version the cluster's CRD has
stored objects at, so the apiserver takes it and keeps the DGDs other tests made. A swap that stores
another version than ours (v1beta1), such as ``operators()`` (v1alpha1, as Dynamo's older operators), is
undone by a storage migration: every DGD is deleted (they may be stored at that version), our CRD is put
back, and the other version leaves its storedVersions. The restore waits until v1beta1 is served again.

``apply_file`` applies a DGD manifest file at the version the session's CRD serves (v1beta1), converting
one written at v1alpha1, as ``dynamo-snapshot dgd convert`` does.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from dynamo_snapshot.api import crdgen, protocol
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import DynamoGraphDeploymentV1Beta1
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot_dev.localcluster import LocalCluster
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
    """The DGD CRD of our v1alpha1 model alone (one version, nothing converted), as older releases of this
    project installed it: what the swaps edit."""
    return crdgen.build_crd(DynamoGraphDeployment)


def generated() -> Obj:
    """Ours as crds/ holds it: v1beta1 stored and served, v1alpha1 listed."""
    return crdgen.generated_crd(DynamoGraphDeployment)


OUR_STORAGE = next(v["name"] for v in generated()["spec"]["versions"] if v["storage"])


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


def operators_v1beta1(*, also_v1alpha1: bool = False) -> Obj:
    """NVIDIA's Dynamo operator's CRD as its v1beta1 releases install it: v1beta1 served and stored (its
    schema from our v1beta1 models of Dynamo's), v1alpha1 listed (the DGDs already stored are at it) and
    served only with ``also_v1alpha1``. No conversion webhook: the apiserver relabels stored objects."""
    out = operators()
    [alpha] = out["spec"]["versions"]
    [beta] = crdgen.build_crd(DynamoGraphDeploymentV1Beta1)["spec"]["versions"]
    alpha.update(served=also_v1alpha1, storage=False)
    beta.update(served=True, storage=True)
    out["spec"]["versions"] = [alpha, beta]
    return out


def apply_file(cluster: LocalCluster, namespace: str, path: Path) -> None:
    """``kubectl apply`` of the DGD manifest file ``path``, written at v1beta1 (crds/ serves it alone)."""
    manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    beta = DgdVersion().manifest(manifest)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(beta))


def _storage(crd: Obj) -> str:
    return str(next(v["name"] for v in crd["spec"]["versions"] if v.get("storage")))


def _stored_versions(cluster: LocalCluster) -> list[str]:
    proc = cluster.kubectl("get", "crd", DGD_CRD, "-o", "json", check=False)
    if proc.returncode != 0:
        return []
    return list((json.loads(proc.stdout).get("status") or {}).get("storedVersions") or [])


def _listing_stored_versions(cluster: LocalCluster, crd: Obj) -> Obj:
    """``crd`` plus, unserved, each version the cluster's CRD has stored objects at that it lacks: the
    apiserver refuses a CRD that drops one."""
    out = copy.deepcopy(crd)
    listed = {v["name"] for v in out["spec"]["versions"]}
    schemas = {v["name"]: v for v in generated()["spec"]["versions"]}
    for version in _stored_versions(cluster):
        if version not in listed:
            out["spec"]["versions"].append(
                {**copy.deepcopy(schemas[version]), "served": False, "storage": False}
            )
    return out


def _migrate_back(cluster: LocalCluster) -> None:
    """The DGDs possibly stored at another version than ours go (in every namespace: one left behind could
    not be read, nor the CRD deleted, with nothing to convert it), our CRD stores again, and the other
    version leaves storedVersions."""
    cluster.kubectl("delete", DGD_CRD, "--all", "-A", "--wait=true", "--timeout=60s", check=False)
    cluster.kubectl("replace", "-f", "-", input=json.dumps(generated()))
    stored = json.dumps({"status": {"storedVersions": [OUR_STORAGE]}})
    cluster.kubectl("patch", "crd", DGD_CRD, "--subresource=status", "--type=merge", "-p", stored)


def served(cluster: LocalCluster, version: str) -> bool:
    """Whether the apiserver serves DGDs at ``version`` (its discovery says so: no DGD is read, so an
    object stored at a version nothing converts cannot hide the answer). Also refreshes kubectl's cached
    discovery, which would otherwise resolve `dgd` to the version served before a swap."""
    proc = cluster.kubectl("get", "--raw", f"/apis/nvidia.com/{version}", check=False)
    names = (
        {r.get("name") for r in json.loads(proc.stdout).get("resources", [])}
        if proc.returncode == 0
        else set()
    )
    cluster.kubectl("api-resources", "--api-group=nvidia.com", "-o", "name", check=False)
    return "dynamographdeployments" in names


@contextlib.contextmanager
def dgd_crd_as(cluster: LocalCluster, crd: Obj | None) -> Iterator[None]:
    """The cluster's DGD CRD is ``crd`` (None: there is none) inside the block; ours again after it. With a
    ``crd`` storing another version than ours, every DGD is deleted on the way out."""
    if crd is None:
        cluster.kubectl("delete", "crd", DGD_CRD, "--ignore-not-found", "--wait=true", "--timeout=60s")
    else:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(_listing_stored_versions(cluster, crd)))
    try:
        yield
    finally:
        if crd is None:
            # A Helm release may have made one meanwhile (and kept it): replaced too, it is ours again.
            cluster.install_crds()
        elif _storage(crd) != OUR_STORAGE:
            _migrate_back(cluster)
        # Back as crds/ holds it, as the session started.
        cluster.kubectl("replace", "-f", "-", input=json.dumps(generated()))
        wait_for(lambda: served(cluster, OUR_STORAGE), within=30, what=f"{OUR_STORAGE} DGDs served again")
