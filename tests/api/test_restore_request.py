"""How a pod asks to be restored, read one way by the webhook, the controller and the agent."""

from __future__ import annotations

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_request import container_map, name_problem, restore_from


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
    assert container_map("main=engine-0") == ("main", "engine-0")
    assert container_map(" main = engine ,") == ("main", "engine")
    for bad, why in [
        ("", "is empty"),
        ("a=b,c=d", "names 2 pairs"),
        ("main", "is not source=destination"),
        ("main=", "is not source=destination"),
        ("main=" + "e" * 64, "is not a container name"),
        ("Main=main", "is not a container name"),
    ]:
        with pytest.raises(ValueError, match=why):
            container_map(bad)
