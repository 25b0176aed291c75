"""A restore into several containers of a pod: which containers and keys, and the one condition said
over all of them."""

from __future__ import annotations

from dynamo_snapshot.agent.pod_reports import combined_outcome
from dynamo_snapshot.agent.pod_spec import Destination, destinations, workload_key
from dynamo_snapshot.api import protocol

Restored = protocol.RestoredReason
MAP = protocol.ANNOTATION_RESTORE_CONTAINER_MAP


def _pod(containers: list[str], **annotations: str) -> dict[str, object]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "team-a",
            "uid": "0123456789abcdef",
            "annotations": annotations,
        },
        "spec": {"containers": [{"name": name} for name in containers]},
    }


def test_each_destination_has_its_own_key_the_first_the_pods() -> None:
    pod = _pod(["engine-0", "engine-1"], **{MAP: "main=engine-0,main=engine-1"})
    base = workload_key(pod)
    assert destinations(pod) == (
        Destination("engine-0", base, shared=True),
        Destination("engine-1", f"{base}_engine-1", shared=True),
    )
    assert [d.annotated for d in destinations(pod)] == ["engine-0", "engine-1"]


def test_one_destination_is_the_pods_as_before() -> None:
    assert destinations(_pod(["sidecar", "main"])) == (Destination("main", workload_key(_pod(["main"]))),)
    mapped = _pod(["sidecar", "engine"], **{MAP: "main=engine"})
    [only] = destinations(mapped)
    assert (only.container, only.shared, only.annotated) == ("engine", False, None)
    # A map the agent refuses still names one destination: the refusal is said where the controller reads.
    assert [d.container for d in destinations(_pod(["main"], **{MAP: "main=a,worker=b"}))] == ["main"]


def test_every_container_restored_succeeds() -> None:
    reason, message = combined_outcome(
        [
            ("engine-0", Restored.SUCCEEDED, "restored in 1s"),
            ("engine-1", Restored.SUCCEEDED, "restored in 2s"),
        ]
    )
    assert reason is Restored.SUCCEEDED
    assert message == "restored into 2 containers: engine-0: restored in 1s; engine-1: restored in 2s"


def test_some_restored_is_partial_and_names_the_failed_first() -> None:
    reason, message = combined_outcome(
        [("engine-0", Restored.SUCCEEDED, "restored"), ("engine-1", Restored.FAILED, "refused: no standby")]
    )
    assert reason is Restored.PARTIALLY_SUCCEEDED
    assert message == "1 of 2 containers restored: engine-1: refused: no standby; engine-0: restored"


def test_none_restored_fails_incompatible_only_where_every_one_was() -> None:
    reason, message = combined_outcome([("a", Restored.FAILED, "x"), ("b", Restored.INCOMPATIBLE, "y")])
    assert (reason, message) == (Restored.FAILED, "no container restored: a: x; b: y")
    reason, message = combined_outcome([("a", Restored.INCOMPATIBLE, "x"), ("b", Restored.INCOMPATIBLE, "y")])
    assert (reason, message) == (Restored.INCOMPATIBLE, "a: x; b: y")
