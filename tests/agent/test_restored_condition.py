"""The pod condition nvidia.com/Restored, written by the node agent for real: pods on kwok nodes of the
real control plane, the worker restored with CRIU, the condition read back from the apiserver.

kwok (the tests' node emulator) writes a pod's status once, when the pod starts running: a strategic
merge that keeps the conditions of other types, and that writes a condition of its own only for the
types the pod lists in spec.readinessGates (it sets them True). The pods here list none, so the
Restored condition read back is the agent's alone; each test also finds it under the agent's field
manager in the pod's managedFields (an Apply on the status subresource owning that one entry), which no
other writer could have put there, and finds kwok's Ready condition still beside it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.watcher import AGENT_NAME
from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, ApiError, Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT
from tests.agent.test_agent import (
    CKPT,
    TARGET,
    AgentHandle,
    _checkpoint_then_second_node,
    _count_calls,
    _event,
    _workload,
    agents,  # noqa: F401  (the fixture)
    pod,
    recorded_checkpoint,
)
from tests.controller.conftest import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.criu]
RESTORED = protocol.POD_CONDITION_RESTORED
MESSAGE = protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")
STATUS = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


async def _outcome(kube: Kube, ns: str, name: str) -> tuple[Obj, Obj]:
    """The pod once its restore status is final and its Restored condition is set; and that condition."""

    async def done() -> tuple[Obj, Obj] | None:
        obj = await kube.get(POD, name, ns)
        cond = _conditions(obj).get(RESTORED)
        final = (obj["metadata"].get("annotations") or {}).get(STATUS) in ("completed", "failed")
        return (
            (obj, cond) if final and cond and cond["reason"] != protocol.RestoredReason.IN_PROGRESS else None
        )

    found: tuple[Obj, Obj] = await eventually(done, within=60)
    return found


def _agent_owns_only_the_condition(obj: Obj) -> None:
    """The agent's field manager applied exactly the Restored entry of the conditions, on pods/status."""
    [entry] = [m for m in obj["metadata"].get("managedFields") or [] if m["manager"] == AGENT_NAME]
    assert (entry["operation"], entry.get("subresource")) == ("Apply", "status"), entry
    assert entry["fieldsV1"] == {
        "f:status": {
            "f:conditions": {
                f'k:{{"type":"{RESTORED}"}}': {
                    ".": {},
                    "f:lastTransitionTime": {},
                    "f:message": {},
                    "f:reason": {},
                    "f:status": {},
                    "f:type": {},
                }
            }
        }
    }


def _applied(handle: AgentHandle, fail: Callable[[Obj], Exception | None] | None = None) -> list[Obj]:
    """Every Restored condition the agent applies from now on, in order; ``fail`` may turn one down
    (an exception to raise in place of the apiserver's answer, or None to send it)."""
    real = handle.agent.kube.apply
    sent: list[Obj] = []

    async def spy(kind: Any, obj: Obj, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("subresource") == "status" and kind is POD:
            [cond] = obj["status"]["conditions"]
            sent.append(dict(cond))
            error = fail(cond) if fail else None
            if error is not None:
                raise error
        return await real(kind, obj, *args, **kwargs)

    handle.agent.kube.apply = spy  # type: ignore[method-assign]
    return sent


async def test_a_restored_pod_has_restored_true_and_a_restore_succeeded_event(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    sent = _applied(b)
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    obj, cond = await _outcome(kube, namespace, "restored")

    message = obj["metadata"]["annotations"][MESSAGE]
    assert obj["metadata"]["annotations"][STATUS] == "completed", message
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "RestoreSucceeded", message)
    assert message.startswith(f"restored from {CKPT} in "), message
    # Started, then done: False while it ran, True from when it finished.
    assert [(c["status"], c["reason"], c["message"]) for c in sent] == [
        ("False", "RestoreInProgress", f"restoring from {CKPT}"),
        ("True", "RestoreSucceeded", message),
    ]
    assert sent[0]["lastTransitionTime"] <= cond["lastTransitionTime"] == sent[1]["lastTransitionTime"]
    assert _conditions(obj)["Ready"]["status"] == "True", "the pod's other conditions are kept"
    _agent_owns_only_the_condition(obj)
    event = await _event(kube, namespace, "RestoreSucceeded", "restored")
    assert (event["type"], event["message"]) == ("Normal", message)


@pytest.mark.parametrize("case", ["missing", "not-ready"])
async def test_a_refused_restore_has_restored_false_with_the_reason(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    case: str,
) -> None:
    """restore-from naming nothing of the namespace, or a PodSnapshot never captured: the pod says why in
    its annotations, a Warning Event and its Restored condition, all with the same words."""
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    name = f"{case}-snapshot"
    if case == "not-ready":
        await kube.create(
            POD_SNAPSHOT,
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "PodSnapshot",
                "metadata": {"name": name},
                "spec": {"source": {"podRef": {"name": "absent", "containers": ["main"]}}},
            },
            namespace,
        )
    manifest = pod("refused", node, {})
    del manifest["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
    manifest["metadata"]["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: name}
    await kube.create(POD, manifest, namespace)
    obj, cond = await _outcome(kube, namespace, "refused")

    message = obj["metadata"]["annotations"][MESSAGE]
    assert obj["metadata"]["annotations"][STATUS] == "failed"
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "RestoreFailed", message)
    assert message.startswith("refused: "), message
    assert repr(name) in message, message
    if case == "not-ready":
        assert f"PodSnapshot {name!r} is not Ready" in message
    else:
        assert message == (
            f"refused: neither a DynamoCheckpoint nor a PodSnapshot named {name!r} exists in namespace "
            f"{namespace}: a pod is restored only from one of its own namespace"
        )
    assert _conditions(obj)["Ready"]["status"] == "True", "the pod's other conditions are kept"
    _agent_owns_only_the_condition(obj)
    event = await _event(kube, namespace, "RestoreRefused", "refused")
    assert (event["type"], event["message"]) == ("Warning", message)


async def test_a_failed_restore_keeps_the_transition_time_of_its_start(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
) -> None:
    """Restored stays False from the start of a restore to its failure: its lastTransitionTime is the
    start's, though the failure comes seconds later. The checkpoint, its PodSnapshot and content record
    a digest (the grant); the executor fails the restore after a while, as a bad artifact would."""
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    handle = await agents(node)
    await recorded_checkpoint(kube, namespace, "a" * 64)

    async def failing_restore(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(2.2)  # past a whole second of the condition's timestamps
        raise AgentError("the artifact could not be read (test)")

    handle.agent.executor.restore = failing_restore
    sent = _applied(handle)
    await kube.create(POD, pod("failing", node, TARGET), namespace)
    obj, cond = await _outcome(kube, namespace, "failing")

    assert (cond["status"], cond["reason"]) == ("False", "RestoreFailed")
    assert (
        cond["message"] == obj["metadata"]["annotations"][MESSAGE] == "the artifact could not be read (test)"
    )
    assert [c["reason"] for c in sent] == ["RestoreInProgress", "RestoreFailed"]
    assert cond["lastTransitionTime"] == sent[0]["lastTransitionTime"]
    event = await _event(kube, namespace, "RestoreFailed", "failing")
    assert event["message"] == cond["message"]


async def test_a_restored_condition_turned_down_is_retried_leaving_the_worker_running(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
) -> None:
    """The apiserver turns down the first write of Restored True: it is written again, and the healthy
    restored worker is neither torn down nor restored anew."""
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    refused: list[str] = []

    def once(cond: Obj) -> Exception | None:
        if cond["reason"] == "RestoreSucceeded" and not refused:
            refused.append(cond["reason"])
            return ApiError(503, "ServiceUnavailable", "transient: etcd leader changed")
        return None

    sent = _applied(b, once)
    restores = _count_calls(b.agent.executor, "restore")
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    _, cond = await _outcome(kube, namespace, "restored")
    assert (cond["status"], cond["reason"]) == ("True", "RestoreSucceeded")
    assert refused == ["RestoreSucceeded"]
    assert [c["reason"] for c in sent] == ["RestoreInProgress", "RestoreSucceeded", "RestoreSucceeded"]
    assert len(restores) == 1, "the healthy restored worker was torn down and restored anew"
    assert await _workload(kube, b.runtime, namespace, "restored") is not None
