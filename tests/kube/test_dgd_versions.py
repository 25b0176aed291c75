"""DGDs read at v1beta1 and seen in v1alpha1's shape (kube/dgd_versions.py), without a cluster: the view of
every upstream v1beta1 example and of every repo example written at v1beta1 goes back to the object it
came from, a status written through a view lands in v1beta1's fields, an object the conversion refuses
is marked and refused by ``model`` instead of read as a graph of no services, and the autoscaler scales
the stored component at its index."""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import yaml
from pydantic import ValidationError

from dynamo_snapshot.api.dgd_conversion import V1ALPHA1, V1BETA1
from dynamo_snapshot.autoscale.targets import Found, OwnDgds
from dynamo_snapshot.kube import Informer, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import UNREADABLE_ANNOTATION, DgdUnreadable, DgdVersion, read_version
from tests.api.test_dgd_v1beta1 import ALPHA_EXAMPLES, FIXTURES

BETA, ALPHA = DgdVersion(), DgdVersion("v1alpha1")
UPSTREAM = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in FIXTURES]


def _stored(dgd: Obj) -> Obj:
    """``dgd`` as the apiserver hands it back: with server metadata."""
    out = copy.deepcopy(dgd)
    out["metadata"].update(namespace="ns", uid="u-1", resourceVersion="7", generation=1)
    return out


@pytest.mark.parametrize("beta", UPSTREAM, ids=[p.stem for p in FIXTURES])
def test_a_v1beta1_object_is_viewed_as_v1alpha1_and_stored_back_unchanged(beta: Obj) -> None:
    obj = _stored(beta)
    view = BETA.view(obj)
    # The apiVersion stays the one read: ownerReferences and Events made from the view name it.
    assert view["apiVersion"] == V1BETA1
    assert set(view["spec"]["services"]) == {c["name"] for c in beta["spec"]["components"]}
    assert BETA.model(view).spec.services
    assert BETA.stored(view) == obj
    assert BETA.manifest(beta) is beta


@pytest.mark.parametrize(("where", "alpha"), ALPHA_EXAMPLES, ids=[w for w, _ in ALPHA_EXAMPLES])
def test_a_v1alpha1_manifest_is_written_at_v1beta1_and_viewed_as_it_was(where: str, alpha: Obj) -> None:
    written = BETA.manifest(alpha)
    assert written["apiVersion"] == V1BETA1
    view = BETA.view(_stored(written))
    assert {**view, "apiVersion": V1ALPHA1} == _stored(alpha)
    # Read at v1alpha1 (a CRD that serves only it), nothing is converted.
    assert ALPHA.manifest(alpha) is alpha
    assert ALPHA.view(alpha) is alpha
    assert ALPHA.stored(alpha) is alpha


def test_a_status_written_through_the_view_is_v1beta1s() -> None:
    view = BETA.view(_stored(UPSTREAM[0]))
    status = {
        "observedGeneration": 1,
        "state": "pending",
        "conditions": [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "m"}],
        "services": {"VllmDecodeWorker": {"replicas": 1, "readyReplicas": 0, "restoredReplicas": 1}},
        "checkpoints": {"VllmDecodeWorker": {"checkpointName": "c", "ready": True}},
    }
    body = BETA.stored({**view, "status": status})
    assert body["status"]["components"] == status["services"]
    assert "services" not in body["status"]
    assert body["status"]["checkpoints"] == status["checkpoints"]
    # Nothing kept aside: the status subresource would drop an annotation.
    assert "nvidia.com/dgd-status" not in (body["metadata"].get("annotations") or {})
    assert BETA.view(body)["status"] == status


def test_an_object_the_conversion_refuses_is_marked_and_not_read_as_an_empty_graph() -> None:
    broken = _stored(UPSTREAM[0])
    broken["spec"]["components"].append(copy.deepcopy(broken["spec"]["components"][0]))
    view = BETA.view(broken)
    assert "two components named" in view["metadata"]["annotations"][UNREADABLE_ANNOTATION]
    unreadable = r"cannot be read as nvidia\.com/v1alpha1: .*two components named"
    with pytest.raises(DgdUnreadable, match=unreadable):
        BETA.model(view)
    # Written back (a status saying why), it is the object as read.
    assert BETA.stored(view) == broken


def test_an_invalid_view_is_refused_by_the_v1alpha1_model() -> None:
    bad = _stored(UPSTREAM[0])
    bad["spec"]["components"][1]["replicas"] = -1
    with pytest.raises(ValidationError, match="replicas"):
        BETA.model(BETA.view(bad))


def test_read_version_prefers_v1beta1() -> None:
    def crd(**served: bool) -> Obj:
        return {"spec": {"versions": [{"name": n, "served": s} for n, s in served.items()]}}

    assert read_version(crd(v1alpha1=True, v1beta1=True)) == "v1beta1"
    assert read_version(crd(v1alpha1=True, v1beta1=False)) == "v1alpha1"
    assert read_version(crd(v1alpha1=False, v1beta1=False)) is None
    assert read_version(None) is None


class _Patches:
    """Records the JSON patches written."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[Obj]]] = []

    async def json_patch(self, kind: Any, name: str, ops: list[Obj], namespace: str) -> Obj:
        self.calls.append((kind.version, name, ops))
        return {}


async def test_the_autoscaler_writes_the_stored_component_at_its_index() -> None:
    # Components out of name order: the view keeps their order aside, the index is the stored one.
    beta = _stored(UPSTREAM[0])
    beta["spec"]["components"].reverse()
    names = [c["name"] for c in beta["spec"]["components"]]
    assert names != sorted(names)
    kube = _Patches()
    informer = cast(Informer, None)
    targets = OwnDgds(cast(Kube, kube), informer, informer, BETA)
    view = BETA.view(beta)
    service = names[0]
    await targets.scale(Found(view, service, 1), 3)
    [(version, name, ops)] = kube.calls
    assert (version, name) == ("v1beta1", beta["metadata"]["name"])
    assert ops == [
        {"op": "test", "path": "/spec/components/0/name", "value": service},
        {"op": "add", "path": "/spec/components/0/replicas", "value": 3},
    ]
