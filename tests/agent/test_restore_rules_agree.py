"""The restore webhook and the node agent judge a pod's restore request alike: a value the webhook denies
is one the agent refuses with the same reason (an agent meets such pods where no webhook ran: failure
policy Ignore, pods created before it was installed), and a map the webhook admits the agent follows."""

from __future__ import annotations

import pytest

from dynamo_snapshot.agent.authorize import Refused, restore_grant
from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.snapshot.restore_mutation import Found, mutate
from tests.agent.test_authorize import _content, _snapshot, _target


@pytest.mark.parametrize("name", [" ckpt-checkpoint", "ckpt-checkpoint ", "team-b/ckpt-checkpoint", "CKPT"])
def test_a_name_the_webhook_denies_the_agent_refuses_alike(name: str) -> None:
    pod = _target(name=name)
    denied = mutate(pod, "team-a", Found(snapshot=_snapshot(owner_uid=None), content=_content())).denied
    assert denied
    with pytest.raises(Refused) as refused:
        restore_grant(pod, None, _snapshot(owner_uid=None), _content())
    assert str(refused.value) == denied


@pytest.mark.parametrize(
    ("mapping", "admitted"),
    [
        ("main=main", True),
        (" main = main ", True),
        ("main=main,", True),
        ("main=engine", False),
        ("engine=main", False),  # the snapshot captured main
        ("main", False),
    ],
)
def test_a_container_map_is_admitted_and_followed_alike(mapping: str, admitted: bool) -> None:
    pod = _target(name="ckpt-checkpoint")
    pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_CONTAINER_MAP] = mapping
    pod["spec"] = {"containers": [{"name": "main", "image": "worker:1"}]}
    found = Found(snapshot=_snapshot(owner_uid=None), content=_content())
    assert (mutate(pod, "team-a", found).denied is None) is admitted
    if admitted:
        restore_grant(pod, None, _snapshot(owner_uid=None), _content())
    else:
        with pytest.raises(Refused):
            restore_grant(pod, None, _snapshot(owner_uid=None), _content())
