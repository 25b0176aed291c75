"""How a pod asks to be restored, read one way by the webhook, the controller and the agent."""

from __future__ import annotations

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_request import (
    container_map,
    name_problem,
    restore_destinations,
    restore_from,
)


def test_the_annotation_is_read_as_written() -> None:
    assert restore_from(None) is None
    assert restore_from({}) is None
    assert restore_from({protocol.ANNOTATION_RESTORE_FROM: " ckpt "}) == " ckpt "
    assert restore_from({protocol.ANNOTATION_RESTORE_FROM: ""}) == ""


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("other/ckpt", "no cross-namespace restore"),
        ("", "is empty"),
        ("   ", "is empty"),
        (" ckpt", "is not an object name"),
        ("ckpt\n", "is not an object name"),
        ("Ckpt", "is not an object name"),
        ("c" * 254, "is not an object name"),
        ("c" * 64, "longer than 63 characters"),
    ],
)
def test_a_name_that_is_no_object_of_the_namespace_has_a_problem(name: str, why: str) -> None:
    assert why in (name_problem(name, "team-a") or "")


def test_an_object_name_has_none() -> None:
    assert name_problem("ckpt-1.v2", "team-a") is None


def test_container_map() -> None:
    assert container_map("main=engine-0") == ("main", ("engine-0",))
    assert container_map(" main = engine ,") == ("main", ("engine",))
    assert container_map("main=engine-1,main=engine-0") == ("main", ("engine-1", "engine-0")), "as written"
    for bad, why in [
        ("", "is empty"),
        ("a=b,c=d", "names 2 sources"),
        ("main=a,main=a", "names destination 'a' twice"),
        ("main=a,main", "'main' is not source=destination"),
        ("main", "is not source=destination"),
        ("main=", "is not source=destination"),
        ("main=" + "e" * 64, "is not a container name"),
        ("Main=main", "is not a container name"),
    ]:
        with pytest.raises(ValueError, match=why):
            container_map(bad)


def test_a_restore_goes_where_the_map_says_else_into_the_captured_name() -> None:
    assert restore_destinations(None, "worker") == ("worker",)
    assert restore_destinations(None, None) == (protocol.DEFAULT_TARGET_CONTAINER,)
    assert restore_destinations("worker=engine", "worker") == ("engine",)
    assert restore_destinations("main=engine-0,main=engine-1", "main") == ("engine-0", "engine-1")
    assert restore_destinations("x=engine", None) == ("engine",), (
        "the captured container unknown: taken as given"
    )
    with pytest.raises(
        ValueError, match="the snapshot captured container 'main', not 'worker': write main=engine"
    ):
        restore_destinations("worker=engine", "main")
    with pytest.raises(ValueError, match="write main=e0,main=e1"):
        restore_destinations("worker=e0,worker=e1", "main")
    with pytest.raises(ValueError, match="is not source=destination"):
        restore_destinations("engine", "main")
