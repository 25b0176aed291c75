"""A small controller runtime over plain dicts: REST client, informers, workqueue, leader election, events.

Generic on purpose: nothing here knows Dynamo's resources, so it imports no ``dynamo_snapshot.api`` model.
"""

from dynamo_snapshot.controller.runtime.events import NORMAL, WARNING, EventRecorder, ObjectRef
from dynamo_snapshot.controller.runtime.informer import ADDED, DELETED, MODIFIED, EventHandler, Informer
from dynamo_snapshot.controller.runtime.kube import (
    CONFIG_MAP,
    EVENT,
    LEASE,
    NAMESPACE,
    NODE,
    POD,
    ApiError,
    Kube,
    Obj,
    ResourceKind,
    conflict_retry,
    controller_ref,
    is_already_exists,
    is_conflict,
    is_gone,
    is_not_found,
    load_client,
    object_key,
)
from dynamo_snapshot.controller.runtime.leader import LeaderElector
from dynamo_snapshot.controller.runtime.workqueue import Result, WorkQueue

__all__ = [
    "ADDED",
    "CONFIG_MAP",
    "DELETED",
    "EVENT",
    "LEASE",
    "MODIFIED",
    "NAMESPACE",
    "NODE",
    "NORMAL",
    "POD",
    "WARNING",
    "ApiError",
    "EventHandler",
    "EventRecorder",
    "Informer",
    "Kube",
    "LeaderElector",
    "Obj",
    "ObjectRef",
    "ResourceKind",
    "Result",
    "WorkQueue",
    "conflict_retry",
    "controller_ref",
    "is_already_exists",
    "is_conflict",
    "is_gone",
    "is_not_found",
    "load_client",
    "object_key",
]
