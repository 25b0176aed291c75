"""Adding and removing one finalizer of an object, as conditional writes: the list is replaced whole, so
the write carries the resourceVersion it was read at, and a concurrent change makes it fail (409) instead
of dropping another controller's finalizer."""

from __future__ import annotations

from dynamo_snapshot.kube.kube import Kube, Obj, ResourceKind, is_not_found

__all__ = ["add_finalizer", "remove_finalizer"]


async def add_finalizer(kube: Kube, kind: ResourceKind, obj: Obj, finalizer: str) -> None:
    """Hold ``obj`` with ``finalizer``; its resourceVersion in ``obj`` is updated to the write's."""
    meta = obj["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if finalizer in finalizers:
        return
    patch = {"metadata": {"finalizers": [*finalizers, finalizer], "resourceVersion": meta["resourceVersion"]}}
    updated = await kube.merge_patch(kind, meta["name"], patch, meta.get("namespace"))
    meta["resourceVersion"] = updated["metadata"]["resourceVersion"]


async def remove_finalizer(kube: Kube, kind: ResourceKind, obj: Obj, finalizer: str) -> None:
    """Release ``obj`` from ``finalizer``; an object already gone is released."""
    meta = obj["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if finalizer not in finalizers:
        return
    patch = {
        "metadata": {
            "finalizers": [f for f in finalizers if f != finalizer],
            "resourceVersion": meta["resourceVersion"],
        }
    }
    try:
        await kube.merge_patch(kind, meta["name"], patch, meta.get("namespace"))
    except Exception as e:
        if not is_not_found(e):
            raise
