"""What a target write that the apiserver refuses tells the policy: the reason and what to grant."""

from __future__ import annotations

from typing import Any, cast

import pytest

from dynamo_snapshot.autoscale.targets import Found, OperatorDgds, ScaleFailed, adapter_kind
from dynamo_snapshot.kube import ApiError, Kube, Obj

DGD: Obj = {"metadata": {"name": "g", "namespace": "ns"}}
ADAPTER: Obj = {"metadata": {"name": "g-decode", "namespace": "ns"}}


class Refusing:
    """Answers every write with ``error``; records what was called."""

    def __init__(self, error: ApiError) -> None:
        self.error, self.calls = error, []

    def __getattr__(self, name: str) -> Any:
        async def call(*_args: Any) -> Obj:
            self.calls.append(name)
            raise self.error

        return call


async def _scale(error: ApiError, *, adapter: bool, index: int | None) -> tuple[ScaleFailed, list[str]]:
    kube = Refusing(error)
    targets = OperatorDgds(cast(Kube, kube), None)
    targets.adapter_kind = adapter_kind("v1alpha1")
    found = Found(DGD, "decode", 1, adapter=ADAPTER if adapter else None, index=index)
    with pytest.raises(ScaleFailed) as e:
        await targets.scale(found, 3)
    return e.value, kube.calls


@pytest.mark.parametrize(
    ("adapter", "index", "call", "needs"),
    [
        (True, 1, "get_scale", "get and update on dynamographdeploymentscalingadapters/scale"),
        (False, 1, "json_patch", "patch on dynamographdeployments"),
        (False, None, "merge_patch", "patch on dynamographdeployments"),
    ],
)
async def test_a_forbidden_write_names_the_verbs_the_write_uses(
    adapter: bool, index: int | None, call: str, needs: str
) -> None:
    failed, calls = await _scale(ApiError(403, "Forbidden", "no"), adapter=adapter, index=index)
    assert calls == [call]
    assert failed.reason == "ScaleForbidden"
    assert f"needs {needs} in group nvidia.com" in failed.message


async def test_a_failed_test_op_is_a_conflict_not_a_failure() -> None:
    failed, _ = await _scale(ApiError(422, "Invalid", ""), adapter=False, index=1)
    assert failed.reason == "ScaleConflict"
    assert "spec.components[1] is no longer decode" in failed.message
