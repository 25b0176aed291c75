"""How a pod asks to be restored, read and judged one way by the restore webhook, the controller and the
node agent: ``nvidia.com/restore-from`` names a DynamoCheckpoint or a PodSnapshot of the pod's own
namespace, and ``nvidia.com/restore-container-map`` maps the captured container onto one or several of
the pod's (each destination restored on its own).

A value is taken as written: a name with spaces around it is no object's name, whoever reads it, so the
webhook that denies it and an agent that meets it without a webhook (failurePolicy Ignore, a pod created
before the webhook ran) say the same thing."""

from __future__ import annotations

import re
from collections.abc import Mapping

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.kube import (
    DNS1123_SUBDOMAIN_MAX_LENGTH,
    DNS1123_SUBDOMAIN_PATTERN,
    LABEL_VALUE_MAX_LENGTH,
)
from dynamo_snapshot.api.podsnapshot import CONTAINER_NAME_PATTERN

__all__ = ["container_map", "name_problem", "restore_destinations", "restore_from"]

_SUBDOMAIN = re.compile(DNS1123_SUBDOMAIN_PATTERN)
_CONTAINER = re.compile(CONTAINER_NAME_PATTERN)


def restore_from(annotations: Mapping[str, object] | None) -> str | None:
    """The value of ``nvidia.com/restore-from`` as written; None when the annotation is not there."""
    value = (annotations or {}).get(protocol.ANNOTATION_RESTORE_FROM)
    return None if value is None else str(value)


def name_problem(name: str, namespace: str) -> str | None:
    """Why ``name`` cannot be what a pod of ``namespace`` restores from, else None."""
    key = protocol.ANNOTATION_RESTORE_FROM
    if "/" in name:
        return (
            f"{key}={name!r}: there is no cross-namespace restore; a pod is restored only from a "
            f"PodSnapshot or DynamoCheckpoint of its own namespace ({namespace}): give that object's "
            "name alone"
        )
    if not name.strip():
        return f"{key} is empty: give the name of a PodSnapshot or DynamoCheckpoint of namespace {namespace}"
    if len(name) > DNS1123_SUBDOMAIN_MAX_LENGTH or not _SUBDOMAIN.fullmatch(name):
        return (
            f"{key}={name!r} is not an object name (a DNS-1123 subdomain: lowercase letters, digits, "
            "'-' and '.', starting and ending with a letter or digit)"
        )
    if len(name) > LABEL_VALUE_MAX_LENGTH:
        return (
            f"{key}={name!r} is longer than {LABEL_VALUE_MAX_LENGTH} characters: the restore pod carries "
            f"it as the label {protocol.LABEL_CHECKPOINT_ID}, whose values are at most that long"
        )
    return None


def container_map(value: str) -> tuple[str, tuple[str, ...]]:
    """The source and the destinations of ``nvidia.com/restore-container-map``: comma-separated
    ``source=destination`` pairs of one source (Dynamo's engine failover restores one snapshot into
    ``engine-0`` and its shadows: ``main=engine-0,main=engine-1``), each destination once, in the order
    written. ValueError with the reason when the value is not that."""
    key = protocol.ANNOTATION_RESTORE_CONTAINER_MAP
    pairs = [p.strip() for p in value.split(",") if p.strip()]
    if not pairs:
        raise ValueError(f"{key} is empty: give source=destination, or leave the annotation out")
    sources: list[str] = []
    destinations: list[str] = []
    for pair in pairs:
        source, eq, dest = (part.strip() for part in pair.partition("="))
        if not eq or not source or not dest:
            raise ValueError(f"{key}={value!r}: {pair!r} is not source=destination")
        for role, name in (("source", source), ("destination", dest)):
            if len(name) > LABEL_VALUE_MAX_LENGTH or not _CONTAINER.fullmatch(name):
                raise ValueError(
                    f"{key}={value!r}: {role} {name!r} is not a container name (a DNS-1123 label)"
                )
        if dest in destinations:
            raise ValueError(
                f"{key}={value!r} names destination {dest!r} twice: a container takes one restore"
            )
        if source not in sources:
            sources.append(source)
        destinations.append(dest)
    if len(sources) > 1:
        raise ValueError(
            f"{key}={value!r} names {len(sources)} sources ({', '.join(sources)}): a snapshot is restored "
            "from its one captured container, give that one as every pair's source"
        )
    return sources[0], tuple(destinations)


def restore_destinations(mapping: str | None, captured: str | None) -> tuple[str, ...]:
    """The containers a restore of the captured container ``captured`` goes into: the destinations of
    ``nvidia.com/restore-container-map`` (``mapping``; its source must be ``captured`` where that is
    known), else the captured container's name (main where unknown). ValueError with the reason when the
    map is malformed or maps another container."""
    if mapping is None:
        return (captured or protocol.DEFAULT_TARGET_CONTAINER,)
    source, destinations = container_map(mapping)
    if captured is not None and source != captured:
        pairs = ",".join(f"{captured}={dest}" for dest in destinations)
        raise ValueError(
            f"{protocol.ANNOTATION_RESTORE_CONTAINER_MAP}={mapping!r}: the snapshot captured container "
            f"{captured!r}, not {source!r}: write {pairs}"
        )
    return destinations
