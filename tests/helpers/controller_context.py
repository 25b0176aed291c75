"""A controller Context for pure-logic tests: every informer and the client left out (None), but for the
node cache a test hands in."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.kube import Informer


def bare_context(*, nodes: Any = None, settings: ControllerConfig | None = None) -> Context:
    """Only the node questions (and what reads `settings`) can be asked of it."""
    unused = cast(Any, None)
    caches = {f.name: unused for f in fields(Context) if f.type in (Informer, "Informer")}
    caches["nodes"] = cast(Informer, nodes)
    extra = {} if settings is None else {"settings": settings}
    return Context(kube=unused, recorder=unused, **caches, **extra)
