"""The API vocabulary: custom resource models, the identity hash and the protocol names.

The lowest layer of the project: it imports nothing from other dynamo_snapshot packages, so every
other layer can depend on it.
"""

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
