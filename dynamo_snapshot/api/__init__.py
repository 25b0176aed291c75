"""The API vocabulary: custom resource models, the identity hash and the protocol names.

The lowest layer of the project: it imports nothing from other dynamo_snapshot packages, so every
other layer can depend on it. The models load on first use: a worker that needs only the protocol
names (``dynamo_snapshot.api.protocol``, through the workload SDK) starts without pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
    from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
    from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity, compute_identity_hash

__all__ = [
    "BackendFramework",
    "CheckpointIdentity",
    "DynamoCheckpoint",
    "DynamoGraphDeployment",
    "compute_identity_hash",
]

_HOME = {
    "BackendFramework": "identity",
    "CheckpointIdentity": "identity",
    "compute_identity_hash": "identity",
    "DynamoCheckpoint": "checkpoint",
    "DynamoGraphDeployment": "graphdeployment",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
