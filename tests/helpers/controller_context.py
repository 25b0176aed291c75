"""A controller Context for pure-logic tests: every informer and the client left out (None), but for the
caches a test hands in."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.kube import Informer


def bare_context(*, settings: ControllerConfig | None = None, **caches: Any) -> Context:
    """Only what reads the handed-in caches (by field name: nodes=, snapshots=, ...) and `settings` can be
    asked of it."""
    unused = cast(Any, None)
    given = {f.name: caches.pop(f.name, unused) for f in fields(Context) if f.type in (Informer, "Informer")}
    assert not caches, f"no such cache on the Context: {sorted(caches)}"
    extra = {} if settings is None else {"settings": settings}
    return Context(kube=unused, recorder=unused, **given, **extra)
