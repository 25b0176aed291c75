"""What a checkpoint or restore on this node fails with (the message goes into the pod's annotation as it
is), and how a write to the apiserver that failed is retried. Imports nothing of the Kubernetes client:
the executor, which runs without one (the GPU benchmarks, `dynamo-snapshot checkpoint`), raises these."""

from __future__ import annotations

__all__ = ["RETRY_BASE_S", "RETRY_CAP_S", "AgentError", "ArtifactRefused", "Incompatible", "backoff"]

RETRY_BASE_S, RETRY_CAP_S = 1.0, 60.0


def backoff(attempt: int) -> float:
    return min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** (attempt - 1))


class AgentError(Exception):
    """A checkpoint or restore failed; the message goes into the pod's annotation as it is."""


class ArtifactRefused(AgentError):
    """The artifact's files (or its manifest) are not what it sealed: missing, truncated, altered; or it is
    not the artifact the checkpoint recorded, or it needs a format feature this agent cannot read."""


class Incompatible(AgentError):
    """This node or the restore container cannot run the checkpoint (another GPU product or driver, another
    image, too little free GPU memory): refused before anything of the artifact is read or started, so the
    restore container is left as it was. The pod's creator may ask for the restore anyway
    (``nvidia.com/snapshot-skip-compat-check``)."""
