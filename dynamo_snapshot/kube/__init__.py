"""Kubernetes mechanics shared by the controller and the node agent, over plain dicts: REST client,
informers, workqueue, leader election, events.

Generic on purpose: nothing in these modules knows Dynamo's resources; only ``kinds`` names them (from the
``dynamo_snapshot.api`` models), for the controller and the agent alike, and ``dgd_versions`` reads and
writes DynamoGraphDeployments at the version their CRD stores.
"""

from dynamo_snapshot.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from dynamo_snapshot.kube.informer import ADDED, DELETED, MODIFIED, EventHandler, Informer
from dynamo_snapshot.kube.kube import (
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
from dynamo_snapshot.kube.leader import LeaderElector
from dynamo_snapshot.kube.workqueue import Result, WorkQueue

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
