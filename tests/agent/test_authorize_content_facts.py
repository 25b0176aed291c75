"""A restore's digest comes from the bound PodSnapshotContent: its status.artifact (our CRD), else the
annotation the agent writes where another operator's CRD prunes that status field. What a pod or its
PodSnapshot (namespaced, a tenant's to write) says of an artifact is never read."""

from __future__ import annotations

import json

import pytest

from dynamo_snapshot.agent.authorize import Refused, restore_grant
from dynamo_snapshot.api import protocol
from tests.agent.test_authorize import DIGEST, SNAP_UID, Obj, _content, _snapshot, _target

OTHER_DIGEST = "cd" * 32


def _annotated(content: Obj, value: str) -> Obj:
    content["metadata"]["annotations"] = {protocol.ANNOTATION_CONTENT_ARTIFACT: value}
    return content


def test_a_content_whose_status_was_pruned_grants_the_digest_of_its_annotation() -> None:
    content = _annotated(_content(digest=None), json.dumps({"location": "/a", "digest": DIGEST}))
    grant = restore_grant(_target(name="ckpt-checkpoint"), None, _snapshot(owner_uid=None), content)
    assert (grant.artifact_key, grant.manifest_digest) == (f"team-a/{SNAP_UID}", DIGEST)


def test_the_contents_status_is_read_before_its_annotation() -> None:
    content = _annotated(_content(digest=DIGEST), json.dumps({"digest": OTHER_DIGEST}))
    grant = restore_grant(_target(name="ckpt-checkpoint"), None, _snapshot(owner_uid=None), content)
    assert grant.manifest_digest == DIGEST


def test_artifact_annotations_on_the_pod_or_the_podsnapshot_grant_nothing() -> None:
    forged = {protocol.ANNOTATION_CONTENT_ARTIFACT: json.dumps({"digest": DIGEST})}
    pod, snapshot = _target(name="ckpt-checkpoint"), _snapshot(owner_uid=None)
    pod["metadata"]["annotations"].update(forged)
    snapshot["metadata"]["annotations"] = forged
    with pytest.raises(Refused) as refused:
        restore_grant(pod, None, snapshot, _content(digest=None))
    assert str(refused.value) == (
        "the content of PodSnapshot 'ckpt-checkpoint' records no artifact digest (status.artifact, "
        "else annotation snapshot.nvidia.com/artifact)"
    )


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("not json", "annotation snapshot.nvidia.com/artifact is not readable: "),
        (json.dumps({"digest": "short"}), "annotation snapshot.nvidia.com/artifact is not readable: digest"),
        (json.dumps(["a"]), "annotation snapshot.nvidia.com/artifact is not readable: "),
    ],
    ids=["not-json", "bad-digest", "not-an-object"],
)
def test_an_unreadable_annotation_is_refused_naming_it(value: str, words: str) -> None:
    content = _annotated(_content(digest=None), value)
    with pytest.raises(Refused) as refused:
        restore_grant(_target(name="ckpt-checkpoint"), None, _snapshot(owner_uid=None), content)
    assert str(refused.value).startswith("the content of PodSnapshot 'ckpt-checkpoint': " + words)
