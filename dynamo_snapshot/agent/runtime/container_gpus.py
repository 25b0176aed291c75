"""Which GPUs a kubelet's container was given, from what its runtime put into it."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["container_gpus_given", "visible_gpus"]

_GPU_NODE = re.compile(r"/dev/nvidia[0-9]+")


def visible_gpus(env: dict[str, str]) -> tuple[str, ...] | None:
    """The GPUs NVIDIA_VISIBLE_DEVICES gives a container (UUIDs or indices, as the device plugin wrote
    them); None when it names none in particular ("all", or unset: CDI injects devices without it)."""
    value = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if value in ("", "all"):
        return None
    if value in ("none", "void"):
        return ()
    return tuple(t.strip() for t in value.split(",") if t.strip())


def container_gpus_given(env: dict[str, str], config: dict[str, Any]) -> tuple[str, ...] | None:
    """``visible_gpus``, except that a container whose environment names no GPUs and whose OCI spec holds
    no GPU device node (no /dev/nvidiaN: no device plugin or CDI gave it one) was given none: a restore
    into it must not put a GPU's state into a pod that never asked for a GPU."""
    named = visible_gpus(env)
    if named is not None or env.get("NVIDIA_VISIBLE_DEVICES", "").strip() == "all":
        return named
    devices = ((config.get("linux") or {}).get("devices")) or []
    paths = [str(d.get("path") or "") for d in devices if isinstance(d, dict)]
    return None if any(_GPU_NODE.fullmatch(p) for p in paths) else ()
