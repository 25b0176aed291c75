"""DynamoGraphDeployments read and written at the version the cluster stores, seen in v1alpha1's shape.

The DGD CRD stores v1beta1, as Dynamo 1.5+ does: this project's ``crds/`` serves v1beta1 alone (nothing
to convert, no webhook needed), its chart serves v1alpha1 beside it through the controller's conversion
webhook, and the older operators' CRDs serve v1alpha1 alone. So a DGD is read and written at v1beta1
wherever that is served, else at v1alpha1 (``read_version``), and converted in this process
(``api.dgd_conversion``) to the one shape the controller's code knows, v1alpha1's. Nothing the controller
does then waits on a webhook, its own included.

``DgdVersion.view`` is that shape, as the informers cache it: spec and status converted to v1alpha1's,
the apiVersion left as read, so that the ownerReferences and Events made from a view name a version the
apiserver serves (the garbage collector cannot follow an owner of an unserved version). ``stored`` turns
a view back for a write at the version it was read at; ``model`` validates it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.dgd_conversion import V1ALPHA1, V1BETA1, ConversionError, to_v1alpha1, to_v1beta1
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.kube.kinds import CRD, DGD
from dynamo_snapshot.kube.kube import ApiError, Kube, Obj, ResourceKind, conflict_retry, is_not_found

__all__ = [
    "DGD_CRD_NAME",
    "UNREADABLE_ANNOTATION",
    "DgdClient",
    "DgdUnreadable",
    "DgdVersion",
    "StorageMigration",
    "migrate_storage",
    "read_version",
]

DGD_CRD_NAME: Final = f"{DGD.plural}.{DGD.group}"
# Marks a cached view whose v1beta1 object could not be converted (the message says why); ``model``
# refuses it, so the reconciler reports it instead of reading a graph of no services. Never written to
# the cluster: ``stored`` removes it.
UNREADABLE_ANNOTATION: Final = "snapshot.nvidia.com/unreadable-dgd"
_PREFERRED: Final = (protocol.API_VERSION_V1BETA1, protocol.API_VERSION)


def read_version(crd: Mapping[str, Any] | None) -> str | None:
    """The version a CRD of Dynamo's is read at: v1beta1 where served, else v1alpha1; None when the CRD
    is absent or serves neither."""
    served = {v.get("name") for v in ((crd or {}).get("spec") or {}).get("versions") or [] if v.get("served")}
    return next((v for v in _PREFERRED if v in served), None)


class DgdUnreadable(ValueError):
    """A DGD that cannot be read as v1alpha1; the message says why."""


@dataclass(frozen=True)
class DgdVersion:
    """The version DGDs are read and written at (v1beta1 unless the CRD serves only v1alpha1)."""

    version: str = protocol.API_VERSION_V1BETA1

    @property
    def kind(self) -> ResourceKind:
        return ResourceKind(DGD.group, self.version, DGD.plural, DGD.kind)

    @property
    def converts(self) -> bool:
        return self.version == protocol.API_VERSION_V1BETA1

    def view(self, obj: Obj) -> Obj:
        """``obj``, as read, in v1alpha1's shape with its own apiVersion; never raises (an object the
        conversion refuses comes back as it is, marked ``UNREADABLE_ANNOTATION``)."""
        if not self.converts:
            return obj
        try:
            alpha = to_v1alpha1({**obj, "apiVersion": V1BETA1})
        except ConversionError as e:
            marked = copy.deepcopy(obj)
            annotations = marked.setdefault("metadata", {}).setdefault("annotations", {})
            annotations[UNREADABLE_ANNOTATION] = str(e)
            return marked
        alpha["apiVersion"] = obj.get("apiVersion", V1BETA1)
        return alpha

    def stored(self, view: Obj) -> Obj:
        """A view (changed or not) as the object to write at this version."""
        if not self.converts:
            return view
        annotations = (view.get("metadata") or {}).get("annotations") or {}
        if UNREADABLE_ANNOTATION in annotations:
            raw = copy.deepcopy(view)
            del raw["metadata"]["annotations"][UNREADABLE_ANNOTATION]
            if not raw["metadata"]["annotations"]:
                del raw["metadata"]["annotations"]
            return raw
        return to_v1beta1({**view, "apiVersion": V1ALPHA1})

    def model(self, view: Obj) -> DynamoGraphDeployment:
        """The view validated by the v1alpha1 model: pydantic's ValidationError, or DgdUnreadable for an
        object the conversion refused."""
        unreadable = ((view.get("metadata") or {}).get("annotations") or {}).get(UNREADABLE_ANNOTATION)
        if unreadable is not None:
            raise DgdUnreadable(f"cannot be read as {V1ALPHA1}: {unreadable}")
        return DynamoGraphDeployment.model_validate({**view, "apiVersion": V1ALPHA1})

    def manifest(self, dgd: Obj) -> Obj:
        """A DGD manifest of either version, as this version writes it."""
        given = dgd.get("apiVersion")
        if given == self.kind.api_version:
            return dgd
        return to_v1beta1(dgd) if self.converts else to_v1alpha1(dgd)


@dataclass(frozen=True)
class StorageMigration:
    """What ``migrate_storage`` did: the DGDs written again, and the CRD's storedVersions before and after."""

    rewritten: int
    before: list[str]
    after: list[str]


async def migrate_storage(kube: Kube) -> StorageMigration:
    """Every DGD written back as it reads at v1beta1, so the apiserver stores it at v1beta1 again, then
    v1alpha1 dropped from the CRD's ``status.storedVersions``: after it no DGD needs a webhook to be read.

    The objects still stored at v1alpha1 (written before the CRD stored v1beta1) are read through the
    conversion webhook, so it must answer while this runs (the chart's controller, webhook.enabled).
    Raises ValueError saying what to do when the CRD does not store v1beta1 or the webhook does not answer.
    """
    crd = await kube.get(CRD, DGD_CRD_NAME)
    target = protocol.API_VERSION_V1BETA1
    storage = next((v.get("name") for v in crd["spec"]["versions"] if v.get("storage")), None)
    if storage != target:
        raise ValueError(
            f"the CRD {DGD_CRD_NAME} stores {storage}, not {target}: install this release's CRD first "
            "(helm upgrade, or kubectl apply --server-side -f crds/)"
        )
    before = list((crd.get("status") or {}).get("storedVersions") or [])
    if before == [target]:
        return StorageMigration(0, before, before)
    kind = DgdVersion().kind
    try:
        items, _ = await kube.list_all(kind)
    except ApiError as e:
        raise ValueError(
            f"cannot read the DynamoGraphDeployments at {target} ({e.message or e.reason}): those stored at "
            f"{protocol.API_VERSION} are read through the conversion webhook, which must answer: run this "
            "with the chart's controller up (webhook.enabled)"
        ) from e
    for item in items:
        meta = item["metadata"]

        async def again(name: str = meta["name"], namespace: str = meta["namespace"]) -> None:
            try:
                await kube.replace(kind, await kube.get(kind, name, namespace))
            except ApiError as e:
                if not is_not_found(e):
                    raise

        await conflict_retry(again)
    after = [target]
    await kube.merge_patch(CRD, DGD_CRD_NAME, {"status": {"storedVersions": after}}, subresource="status")
    return StorageMigration(len(items), before, after)


class DgdClient:
    """DGDs read and written as views, at ``version``: for the CLI's demo, benchmarks and tests, which
    speak v1alpha1 whatever the cluster stores."""

    def __init__(self, kube: Kube, version: DgdVersion | None = None) -> None:
        self.kube = kube
        self.version = version or DgdVersion()

    async def create(self, manifest: Obj, namespace: str | None = None) -> Obj:
        """Create ``manifest`` (either version); the created object as a view."""
        created = await self.kube.create(self.version.kind, self.version.manifest(manifest), namespace)
        return self.version.view(created)

    async def get(self, name: str, namespace: str) -> Obj:
        return self.version.view(await self.kube.get(self.version.kind, name, namespace))

    async def edit(self, name: str, namespace: str, change: Callable[[Obj], None]) -> Obj:
        """Read the view, ``change`` it in place, write it back (whole, conditional on the version read),
        again while a concurrent write conflicts; the written object as a view."""

        async def once() -> Obj:
            view = await self.get(name, namespace)
            change(view)
            return self.version.view(await self.kube.replace(self.version.kind, self.version.stored(view)))

        return await conflict_retry(once)

    async def merge_patch(self, name: str, namespace: str, patch: Obj) -> Obj:
        """An RFC 7386 merge patch of the view (v1alpha1's fields), written at this version."""

        def merge(view: Obj) -> None:
            merged = _merged(view, patch)
            view.clear()
            view.update(merged)

        return await self.edit(name, namespace, merge)

    async def set_replicas(self, name: str, namespace: str, service: str, replicas: int) -> Obj:
        """Scale one service (a v1beta1 component) of a DGD."""

        def scale(view: Obj) -> None:
            services = view.setdefault("spec", {}).setdefault("services", {})
            if service not in services:
                raise KeyError(f"DynamoGraphDeployment {namespace}/{name} has no service {service}")
            services[service]["replicas"] = replicas

        return await self.edit(name, namespace, scale)


def _merged(target: Any, patch: Any) -> Any:
    """RFC 7386: ``patch`` merged into ``target``; a null deletes its key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out
