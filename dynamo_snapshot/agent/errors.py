"""What a checkpoint or restore on this node fails with; the message goes into the pod's annotation as it
is."""

from __future__ import annotations

__all__ = ["AgentError", "ArtifactRefused"]


class AgentError(Exception):
    """A checkpoint or restore failed; the message goes into the pod's annotation as it is."""


class ArtifactRefused(AgentError):
    """The artifact's files (or its manifest) are not what it sealed: missing, truncated, altered; or it is
    not the artifact the checkpoint recorded, or it needs a format feature this agent cannot read."""
