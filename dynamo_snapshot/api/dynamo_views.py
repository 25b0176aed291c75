"""Typed views over the Dynamo layer's objects as the informers' caches hold them (plain dicts), built on
``api.views``: a DynamoGraphDeployment, its services and what its status says of them, and the scaling
adapter outside autoscalers write (pods, nodes and the snapshot kinds are read through ``api.views``).

As in ``api.views``, a view never copies or changes its object, and a field absent, null or of a wrong
type reads as absent. ``GraphDeploymentView`` reads the cached view in ``v1alpha1``'s shape
(``kube.dgd_versions``): ``spec.services`` is a map of service name to service.
``StoredGraphDeploymentView`` reads a DGD as ``v1beta1`` stores it: ``spec.components`` is a list, each
component named by its own ``name``.
"""

from __future__ import annotations

from typing import Any

from dynamo_snapshot.api.views import ObjectView, _int, _list, _map, _str

__all__ = [
    "ComponentView",
    "GraphDeploymentView",
    "ScalingAdapterView",
    "ServiceCheckpointStatusView",
    "ServiceCheckpointView",
    "ServiceReplicaStatusView",
    "ServiceView",
    "StoredGraphDeploymentView",
]

Obj = dict[str, Any]

# The checkpoint mode a service's checkpoint settings default to (api.graphdeployment.CheckpointMode).
AUTO_MODE = "Auto"


class ServiceCheckpointView:
    """A service's ``checkpoint`` settings."""

    def __init__(self, raw: object) -> None:
        self.raw = _map(raw)

    @property
    def enabled(self) -> bool:
        return self.raw.get("enabled") is True

    @property
    def mode(self) -> str:
        return _str(self.raw.get("mode")) or AUTO_MODE

    @property
    def checkpoint_ref(self) -> str:
        return _str(self.raw.get("checkpointRef"))

    @property
    def identity(self) -> Obj:
        """The legacy ``identity``; empty when the service names none."""
        return _map(self.raw.get("identity"))

    @property
    def auto(self) -> bool:
        """The controller finds or creates the checkpoint (``ServiceCheckpointConfig.auto``'s rule)."""
        return self.enabled and not self.checkpoint_ref and self.mode == AUTO_MODE


class _Replicated:
    """A service or component: the replicas it asks for."""

    def __init__(self, raw: object) -> None:
        self.raw = _map(raw)

    @property
    def replicas(self) -> int | None:
        """``replicas`` as written; None when absent."""
        return _int(self.raw.get("replicas"))

    @property
    def desired_replicas(self) -> int:
        """The replicas it asks for: one when it names none."""
        replicas = self.replicas
        return 1 if replicas is None else replicas


class ServiceView(_Replicated):
    """One service of a DGD's ``spec.services``."""

    def __init__(self, name: str, raw: object) -> None:
        super().__init__(raw)
        self.name = name

    @property
    def component_type(self) -> str:
        return _str(self.raw.get("componentType"))

    @property
    def sub_component_type(self) -> str:
        return _str(self.raw.get("subComponentType"))

    @property
    def extra_pod_spec(self) -> Obj:
        return _map(self.raw.get("extraPodSpec"))

    @property
    def main_container(self) -> Obj:
        """``extraPodSpec.mainContainer``: what is merged into the main container; empty when absent."""
        return _map(self.extra_pod_spec.get("mainContainer"))

    @property
    def checkpoint(self) -> ServiceCheckpointView:
        return ServiceCheckpointView(self.raw.get("checkpoint"))


class ServiceCheckpointStatusView:
    """``status.checkpoints.<service>``: the checkpoint a service uses, as last written."""

    def __init__(self, raw: object) -> None:
        self.raw = _map(raw)

    @property
    def checkpoint_name(self) -> str:
        return _str(self.raw.get("checkpointName"))

    @property
    def identity_hash(self) -> str:
        return _str(self.raw.get("identityHash"))

    @property
    def ready(self) -> bool:
        return self.raw.get("ready") is True


class ServiceReplicaStatusView:
    """``status.services.<service>``: its replicas, as last written (0 where absent)."""

    def __init__(self, raw: object) -> None:
        self.raw = _map(raw)

    def _count(self, key: str) -> int:
        return _int(self.raw.get(key)) or 0

    @property
    def replicas(self) -> int:
        return self._count("replicas")

    @property
    def ready_replicas(self) -> int:
        return self._count("readyReplicas")

    @property
    def restored_replicas(self) -> int:
        return self._count("restoredReplicas")

    @property
    def cold_started_replicas(self) -> int:
        return self._count("coldStartedReplicas")


class GraphDeploymentView(ObjectView):
    """A DynamoGraphDeployment."""

    @property
    def services(self) -> dict[str, ServiceView]:
        """``spec.services``, by name, in the spec's order."""
        return {
            name: ServiceView(name, svc)
            for name, svc in _map(self.spec.get("services")).items()
            if isinstance(name, str)
        }

    def service(self, name: str) -> ServiceView | None:
        """The service called ``name``; None when the spec has none of that name."""
        services = _map(self.spec.get("services"))
        return ServiceView(name, services[name]) if name in services else None

    @property
    def state(self) -> str:
        return _str(self.status.get("state"))

    @property
    def observed_generation(self) -> int | None:
        return _int(self.status.get("observedGeneration"))

    def checkpoint_status(self, service: str) -> ServiceCheckpointStatusView:
        """What ``status.checkpoints`` says of ``service`` (empty when nothing)."""
        return ServiceCheckpointStatusView(_map(self.status.get("checkpoints")).get(service))

    def replica_status(self, service: str) -> ServiceReplicaStatusView:
        """What ``status.services`` says of ``service`` (zeros when nothing)."""
        return ServiceReplicaStatusView(_map(self.status.get("services")).get(service))


class ComponentView(_Replicated):
    """One component of a ``v1beta1`` DGD's ``spec.components``, with its index in that list."""

    def __init__(self, index: int, raw: object) -> None:
        super().__init__(raw)
        self.index = index

    @property
    def name(self) -> str:
        return _str(self.raw.get("name"))


class StoredGraphDeploymentView(ObjectView):
    """A DynamoGraphDeployment as ``v1beta1`` stores it (``spec.components``, a list)."""

    def component(self, name: str) -> ComponentView | None:
        """The first component called ``name``, at its index in the list as written; None when none is."""
        for index, raw in enumerate(_list(self.spec.get("components"))):
            if isinstance(raw, dict) and raw.get("name") == name:
                return ComponentView(index, raw)
        return None


class ScalingAdapterView(ObjectView):
    """A DynamoGraphDeploymentScalingAdapter (DGDSA): the replicas an outside autoscaler set on it, and the
    DGD service it scales (``spec.dgdRef``)."""

    @property
    def replicas(self) -> int:
        """``spec.replicas``; 0 when absent."""
        return _int(self.spec.get("replicas")) or 0

    @property
    def dgd_ref(self) -> Obj:
        return _map(self.spec.get("dgdRef"))

    @property
    def dgd_name(self) -> str:
        return _str(self.dgd_ref.get("name"))

    @property
    def service_name(self) -> str:
        """The service it scales: ``dgdRef.serviceName`` (v1alpha1), else ``dgdRef.componentName``
        (v1beta1); empty when it names neither."""
        return _str(self.dgd_ref.get("serviceName")) or _str(self.dgd_ref.get("componentName"))
