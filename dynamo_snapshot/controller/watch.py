"""How informer events reach reconcilers, as tables each layer declares and the manager wires: which
reconciler runs each kind (made from the Context, its keys resynced from one cache), and which events of
which cache wake it, for which keys.

A queue key is (reconciled kind, "namespace/name"); one work queue serves every kind, one reconcile per
key at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.kube import Informer, Obj, Result

QueueKey = tuple[str, str]
# (context, event type, object, the object before the event or None) -> keys of the reconciled kind.
KeysOf = Callable[[Context, str, Obj, Obj | None], Iterable[str]]


class Reconciler(Protocol):
    async def reconcile(self, key: str) -> Result | None: ...


def _always(config: ControllerConfig) -> bool:
    return True


@dataclass(frozen=True)
class Reconciles:
    """`kind`'s objects are reconciled by `new(ctx)`, in the install modes where `runs` says so; every
    key of `cache` is reconciled again each resync."""

    kind: str
    cache: Callable[[Context], Informer]
    new: Callable[[Context], Reconciler]
    runs: Callable[[ControllerConfig], bool] = _always


@dataclass(frozen=True)
class Watch:
    """Every event of `cache` wakes `kind`'s reconciler for the keys `keys` maps it to. A key function may
    also note what the event says in the context (a deletion seen, a node's health)."""

    cache: Callable[[Context], Informer]
    kind: str
    keys: KeysOf
