"""``crds/`` as shipped, with no controller and no conversion webhook anywhere: every one of Dynamo's own
v1beta1 examples (tests/api/fixtures/dgd_v1beta1, with where each came from) applies with ``kubectl apply
-f``, `kubectl get dgd` lists them, each reads back whole through the v1beta1 API, and a namespace holding
them is deleted; v1alpha1 is listed but not served (nothing could convert it). What the v1beta1 model
refuses the apiserver refuses too, with the model's message. DGDs stored at v1alpha1 by an older release
are moved to v1beta1 by ``dgd migrate-storage``."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from pydantic import ValidationError

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.graphdeployment import GRAPH_NAME_MESSAGE, DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import (
    COMPONENT_NAME_MESSAGE,
    DUPLICATE_COMPONENT_MESSAGE,
    JOB_WITH_REF_MESSAGE,
    MIN_AVAILABLE_MESSAGE,
    ONE_EPP_MESSAGE,
    DynamoGraphDeploymentV1Beta1,
)
from dynamo_snapshot.kube import Kube
from dynamo_snapshot.kube.dgd_versions import DgdVersion, migrate_storage
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.test_dgd_v1beta1 import FIXTURES
from tests.helpers import dgd_crd
from tests.helpers.dgd_conversion import current_crd, every_version_served_sync
from tests.helpers.polling import wait_for

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
BETA = DgdVersion()
ALPHA_RESOURCE = "dynamographdeployments.v1alpha1.nvidia.com"
BETA_RESOURCE = "dynamographdeployments.v1beta1.nvidia.com"


def _load(index: int = 0) -> Obj:
    document: Obj = yaml.safe_load(FIXTURES[index].read_text(encoding="utf-8"))
    return document


def _kubectl(cluster: LocalCluster, *args: str, body: Obj | None = None) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(*args, input=json.dumps(body) if body is not None else None, check=False)


@pytest.fixture
def shipped(cluster: LocalCluster, crds: list[str]) -> Obj:
    """The DGD CRD as crds/ installs it (no other module's swap left behind), and nothing that converts."""
    crd = current_crd(cluster)
    generated = crdgen.generated_crd(DynamoGraphDeployment)["spec"]
    assert [v["schema"] for v in crd["spec"]["versions"]] == [v["schema"] for v in generated["versions"]]
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [
        ("v1alpha1", False, False),
        ("v1beta1", True, True),
    ]
    service = crd["spec"]["conversion"]["webhook"]["clientConfig"]["service"]
    gone = _kubectl(cluster, "get", "service", service["name"], "-n", service["namespace"])
    assert gone.returncode != 0, "a Service answers the conversion webhook: this test wants none"
    return crd


@pytest.fixture
def scratch(cluster: LocalCluster) -> Iterator[str]:
    """A namespace this test deletes itself (and checks it goes)."""
    name = f"shipped-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


async def test_every_upstream_v1beta1_example_applies_and_reads_back_with_no_controller(
    cluster: LocalCluster, api: client.ApiClient, shipped: Obj, scratch: str
) -> None:
    assert len(FIXTURES) >= 7
    sent = {}
    for path in FIXTURES:
        proc = _kubectl(cluster, "apply", "-n", scratch, "-f", str(path))
        assert proc.returncode == 0, f"{path.name}: {proc.stderr}"
        manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
        sent[manifest["metadata"]["name"]] = manifest

    listed = _kubectl(cluster, "get", "dgd", "-n", scratch, "-o", "name")
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.split()) == sorted(f"dynamographdeployment.nvidia.com/{n}" for n in sent)
    table = _kubectl(cluster, "get", "dgd", "-n", scratch)
    assert table.stdout.split()[:4] == ["NAME", "READY", "BACKEND", "AGE"], table.stdout

    kube = Kube(api)
    for name, manifest in sent.items():
        stored = await kube.get(BETA.kind, name, scratch)
        assert stored["apiVersion"] == "nvidia.com/v1beta1"
        assert stored["spec"] == manifest["spec"], name
        annotations = stored["metadata"].get("annotations") or {}
        assert annotations.items() >= (manifest["metadata"].get("annotations") or {}).items()
        DynamoGraphDeploymentV1Beta1.model_validate(stored)
        # The controller's view of it: v1alpha1's shape, converted in-process.
        assert BETA.model(BETA.view(stored)).spec.services

    # v1alpha1 is listed (the versions the cluster may still store) but not served: nothing converts.
    alpha = _kubectl(cluster, "get", ALPHA_RESOURCE, "-n", scratch)
    assert alpha.returncode != 0
    assert "the server doesn't have a resource type" in alpha.stderr, alpha.stderr

    # The namespace controller reads what it deletes at the served version: no webhook needed.
    cluster.kubectl("delete", "namespace", scratch, "--wait=false")

    def namespace_gone() -> bool:
        return _kubectl(cluster, "get", "namespace", scratch).returncode != 0

    wait_for(namespace_gone, within=90, what=f"namespace {scratch} deleted with its DGDs")


def _component(name: str, **fields: Any) -> Obj:
    return {"name": name, "type": "worker", "replicas": 1, **fields}


def _graph(*components: Obj, name: str = "g") -> Obj:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"components": list(components)},
    }


def _checkpoint(**fields: Any) -> Obj:
    return {"experimental": {"checkpoint": {"enabled": True, **fields}}}


_JOB = {"gmsClientContainers": ["gms-saver"]}
REFUSED = [
    pytest.param(
        _graph(_component("worker", replicas=-1)), "greater than or equal to 0", id="negative-replicas"
    ),
    pytest.param(
        _graph(_component("worker"), _component("Worker")),
        DUPLICATE_COMPONENT_MESSAGE,
        id="names-differ-in-case",
    ),
    pytest.param(
        _graph(_component("a", type="epp"), _component("b", type="epp")), ONE_EPP_MESSAGE, id="two-epps"
    ),
    pytest.param(_graph(_component("bad_name")), COMPONENT_NAME_MESSAGE, id="bad-component-name"),
    # The schema's maxLength answers first (it bounds the cost of the list's rules).
    pytest.param(
        _graph(_component("w" * 64)),
        f"{COMPONENT_NAME_MESSAGE}|Too long: may not be more than 63",
        id="component-name-too-long",
    ),
    pytest.param(
        _graph(_component("w" * 30), name="g" * 30), "worker pods are named after both", id="pod-names"
    ),
    pytest.param(_graph(_component("worker"), name="g" * 64), GRAPH_NAME_MESSAGE, id="graph-name-too-long"),
    pytest.param(_graph(_component("worker", minAvailable=2)), MIN_AVAILABLE_MESSAGE, id="min-available"),
    pytest.param(
        _graph(_component("worker", **_checkpoint(checkpointRef="snap", job=_JOB))),
        JOB_WITH_REF_MESSAGE,
        id="job-with-checkpoint-ref",
    ),
]


@pytest.mark.parametrize(("bad", "message"), REFUSED)
def test_what_the_v1beta1_model_refuses_the_apiserver_refuses_with_its_message(
    cluster: LocalCluster, shipped: Obj, namespace: str, bad: Obj, message: str
) -> None:
    """``message``: the model's, or the model's|the apiserver's where the schema answers before the rule."""
    model_says, _, apiserver_says = message.partition("|")
    with pytest.raises(ValidationError, match=re.escape(model_says.split(":")[0][:40])):
        DynamoGraphDeploymentV1Beta1.model_validate(bad)
    proc = _kubectl(cluster, "create", "-n", namespace, "-f", "-", body=bad)
    assert proc.returncode != 0, f"the apiserver accepted {json.dumps(bad)}"
    assert (apiserver_says or model_says).split(":")[0] in proc.stderr, proc.stderr
    gone = _kubectl(cluster, "get", "dgd", bad["metadata"]["name"], "-n", namespace)
    assert "NotFound" in gone.stderr


def test_two_components_of_one_name_are_refused(cluster: LocalCluster, shipped: Obj, namespace: str) -> None:
    """The list is keyed by name, as Dynamo's is: the apiserver names the duplicate entry."""
    bad = _graph(_component("worker"), _component("worker", replicas=2))
    proc = _kubectl(cluster, "create", "-n", namespace, "-f", "-", body=bad)
    assert proc.returncode != 0
    assert "spec.components[1]: Duplicate value" in proc.stderr, proc.stderr


def test_an_upstream_example_at_its_limits_is_accepted(
    cluster: LocalCluster, shipped: Obj, namespace: str
) -> None:
    """Names at their limits, CamelCase, a zero-replica component with minAvailable: all admitted."""
    example = copy.deepcopy(_load())
    example["metadata"]["name"] = "g" * 26
    worker = example["spec"]["components"][-1]
    worker.update(name="W" * 30, replicas=0, minAvailable=2)
    DynamoGraphDeploymentV1Beta1.model_validate(example)
    proc = _kubectl(cluster, "create", "-n", namespace, "-f", "-", body=example)
    assert proc.returncode == 0, proc.stderr


def _alpha_graph(name: str) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"services": {"Frontend": {"componentType": "frontend", "replicas": 1}}},
    }


async def test_dgds_stored_at_v1alpha1_before_an_upgrade_are_migrated_to_v1beta1(
    cluster: LocalCluster, api: client.ApiClient, crds: list[str], namespace: str, tmp_path: Path
) -> None:
    """An older release's CRD stored v1alpha1. After the upgrade to crds/ alone those DGDs cannot be read
    (nothing converts them); with the chart's webhook answering, ``dgd migrate-storage`` stores them at
    v1beta1 again, and from then on crds/ alone reads them."""
    kube = Kube(api)
    run = functools.partial(asyncio.to_thread, _kubectl, cluster)
    with dgd_crd.dgd_crd_as(cluster, dgd_crd.ours()):
        for name in ("old-a", "old-b"):
            proc = await run("create", "-n", namespace, "-f", "-", body=_alpha_graph(name))
            assert proc.returncode == 0, proc.stderr
        upgraded = json.dumps(dgd_crd.generated())
        await asyncio.to_thread(cluster.kubectl, "replace", "-f", "-", input=upgraded)
        unreadable = await run("get", BETA_RESOURCE, "-n", namespace)
        assert unreadable.returncode != 0
        assert "conversion webhook" in unreadable.stderr, unreadable.stderr
        with pytest.raises(ValueError, match="must answer: run this with the chart's controller up"):
            await migrate_storage(kube)

        with every_version_served_sync(cluster, tmp_path):
            done = await migrate_storage(kube)
            assert done.rewritten >= 2
            assert (sorted(done.before), done.after) == (["v1alpha1", "v1beta1"], ["v1beta1"])
            assert (await migrate_storage(kube)).rewritten == 0, "a second run has nothing to do"
            await asyncio.to_thread(cluster.kubectl, "replace", "-f", "-", input=upgraded)
            listed = await run("get", BETA_RESOURCE, "-n", namespace, "-o", "name")
            assert listed.returncode == 0, listed.stderr
            assert sorted(listed.stdout.split()) == [
                "dynamographdeployment.nvidia.com/old-a",
                "dynamographdeployment.nvidia.com/old-b",
            ]
            stored = await kube.get(BETA.kind, "old-a", namespace)
            assert [c["name"] for c in stored["spec"]["components"]] == ["Frontend"]
