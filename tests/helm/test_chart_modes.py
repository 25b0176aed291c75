"""The chart's install modes against the real apiserver: `helm template --dry-run=server` lets the DGD CRD
template's lookup see the cluster, so a standalone install over a DGD CRD this release does not own
(NVIDIA's Dynamo operator's, ours applied by kubectl, another release's) is refused with what to do, and
mode dynamo-operator renders beside the operator's CRD without one of its own."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import yaml

from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helm.chart import CHART, REPO, Obj, helm
from tests.helpers import dgd_crd

pytestmark = pytest.mark.cluster

RELEASE, RELEASE_NS = "snap", "snap-system"
AUTO_DGD = REPO / "tests" / "api" / "manifests" / "dgd-vllm-snapshot-auto.yaml"


def _template(cluster: LocalCluster, *sets: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    args = ["template", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--dry-run=server"]
    return helm(*args, "--set", "webhook.enabled=false", *[a for s in sets for a in ("--set", s)], env=env)


def _crds(proc: subprocess.CompletedProcess[str]) -> list[Obj]:
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "CustomResourceDefinition"]


def _of_release(crd: Obj, release: str, namespace: str) -> Obj:
    out = copy.deepcopy(crd)
    out["metadata"]["annotations"] = {
        "meta.helm.sh/release-name": release,
        "meta.helm.sh/release-namespace": namespace,
    }
    return out


def test_standalone_over_the_operators_crd_is_refused_naming_the_mode(
    cluster: LocalCluster, crds: list[str]
) -> None:
    with dgd_crd.dgd_crd_as(cluster, dgd_crd.operators()):
        refused = _template(cluster)
        beside = _template(cluster, "mode=dynamo-operator")
    assert refused.returncode != 0
    assert (
        "mode=standalone installs dynamo-snapshot's DynamoGraphDeployment CRD, but the cluster has a "
        "CustomResourceDefinition dynamographdeployments.nvidia.com that is not dynamo-snapshot's (no label "
        "snapshot.nvidia.com/crd-owner=dynamo-snapshot; NVIDIA's Dynamo operator installs one of this name). "
        "To install beside that operator, set mode=dynamo-operator"
    ) in refused.stderr, refused.stderr
    assert _crds(beside) == []


def test_standalone_over_our_crd_of_no_release_says_how_to_adopt_it(
    cluster: LocalCluster, crds: list[str]
) -> None:
    # The session's CRD was applied from crds/ by kubectl: ours, in no release.
    refused = _template(cluster)
    assert refused.returncode != 0
    assert (
        "dynamographdeployments.nvidia.com is dynamo-snapshot's but belongs to no Helm release"
        in refused.stderr
    )
    assert (
        "kubectl annotate crd dynamographdeployments.nvidia.com meta.helm.sh/release-name=snap "
        "meta.helm.sh/release-namespace=snap-system && kubectl label crd dynamographdeployments.nvidia.com "
        "app.kubernetes.io/managed-by=Helm"
    ) in refused.stderr, refused.stderr


def test_standalone_over_another_releases_crd_is_refused(cluster: LocalCluster, crds: list[str]) -> None:
    with dgd_crd.dgd_crd_as(cluster, _of_release(dgd_crd.ours(), "first", "team-a")):
        refused = _template(cluster)
    assert refused.returncode != 0
    assert (
        "the CustomResourceDefinition dynamographdeployments.nvidia.com belongs to the dynamo-snapshot "
        "release first in namespace team-a: one release per cluster runs mode=standalone"
    ) in refused.stderr, refused.stderr


def test_standalone_upgrades_its_own_crd_and_ignores_a_foreign_release_annotation(
    cluster: LocalCluster, crds: list[str]
) -> None:
    with dgd_crd.dgd_crd_as(cluster, _of_release(dgd_crd.ours(), RELEASE, RELEASE_NS)):
        [crd] = _crds(_template(cluster))
    assert crd["metadata"]["name"] == dgd_crd.DGD_CRD
    # The operator's CRD stays refused even when a release of this name happens to own it.
    with dgd_crd.dgd_crd_as(cluster, _of_release(dgd_crd.operators(), RELEASE, RELEASE_NS)):
        assert "set mode=dynamo-operator" in _template(cluster).stderr


def test_a_standalone_release_owns_the_crd_upgrades_it_and_keeps_it_on_uninstall(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    """helm install for real, into a cluster without the DGD CRD: the release owns the CRD it made, an
    upgrade of it passes the lookup, a second standalone release is refused, and an uninstall leaves the
    CRD and the DGDs in place."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    sets = ["webhook.enabled=false", "agent.admissionPolicy.enabled=false"]
    release = f"r{namespace[-6:]}"

    def chart(verb: str, name: str, ns: str) -> subprocess.CompletedProcess[str]:
        return helm(verb, name, str(CHART), "-n", ns, *[a for s in sets for a in ("--set", s)], env=env)

    with dgd_crd.dgd_crd_as(cluster, None):
        installed = chart("install", release, namespace)
        assert installed.returncode == 0, installed.stderr
        try:
            crd = _crd_json(cluster)
            assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert crd["metadata"]["labels"]["snapshot.nvidia.com/crd-owner"] == "dynamo-snapshot"
            cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{dgd_crd.DGD_CRD}")
            dgd_crd.apply_file(cluster, namespace, AUTO_DGD)  # webhook off: v1beta1 alone is served
            upgraded = chart("upgrade", release, namespace)
            assert upgraded.returncode == 0, upgraded.stderr
            second = chart("install", f"{release}-2", "default")
            assert second.returncode != 0
            assert (
                f"belongs to the dynamo-snapshot release {release} in namespace {namespace}" in second.stderr
            )
        finally:
            uninstalled = helm("uninstall", release, "-n", namespace, "--wait", env=env)
        assert uninstalled.returncode == 0, uninstalled.stderr
        assert _crd_json(cluster)["metadata"]["name"] == dgd_crd.DGD_CRD
        dgds = cluster.kubectl("get", "dynamographdeployments", "-n", namespace, "-o", "name").stdout.split()
        assert dgds == ["dynamographdeployment.nvidia.com/vllm-snapshot-demo"], dgds


def _crd_json(cluster: LocalCluster) -> Obj:
    out = cluster.kubectl("get", "crd", dgd_crd.DGD_CRD, "-o", "json")
    crd: Obj = json.loads(out.stdout)
    return crd


def test_notes_say_the_mode(cluster: LocalCluster, without_dgd_crd: None) -> None:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    args = ["install", "notes", str(CHART), "--namespace", "snap", "--dry-run=client"]
    beside = helm(*args, "--set", "mode=dynamo-operator", env=env)
    assert beside.returncode == 0, beside.stderr
    assert (
        "(mode dynamo-operator: NVIDIA's Dynamo operator runs the DGDs, this controller creates no DGD pods;"
        in (beside.stdout)
    )
    alone = helm(*args, env=env)
    assert "(mode standalone; leader election on" in alone.stdout, alone.stdout
