"""DynamoGraphDeployment nvidia.com/v1alpha1 <-> nvidia.com/v1beta1, losslessly, on plain JSON dicts.

The mapping is Dynamo's (deploy/operator/api/v1alpha1/dynamographdeployment_conversion.go and
shared_spec_conversion.go):

- ``spec.services`` (a map) <-> ``spec.components`` (a list, each entry named by its map key; in name
  order unless the list came in another order); ``spec.envs`` <-> ``spec.env``;
  ``spec.topologyConstraint.topologyProfile`` <-> ``clusterTopologyName``.
- per service: ``componentType: worker`` with ``subComponentType: prefill|decode`` <-> ``type:
  prefill|decode``, other componentTypes <-> ``type``; the pod fields <-> ``podTemplate`` (see
  dgd_podtemplate); ``checkpoint`` <-> ``experimental.checkpoint`` field for field (its ``mode`` and
  ``identity`` are deprecated upstream and carried as given); ``gpuMemoryService``/``failover`` with
  ``enabled: true`` <-> ``experimental.*`` (presence means enabled); ``sharedMemory`` <->
  ``sharedMemorySize`` ("0" when disabled); ``scalingAdapter.enabled: true`` <-> ``scalingAdapter:
  {}``; a compilation-cache volumeMount <-> ``compilationCache``.
- ``status.services`` <-> ``status.components`` (``componentName`` <-> ``componentNames``),
  ``status.rollingUpdate.updatedServices`` <-> ``updatedComponents``.
- every other key, known or not, is carried under the same name.

What one version cannot hold is kept the way Dynamo keeps it: in the reserved annotations
``nvidia.com/dgd-spec`` and ``nvidia.com/dgd-status`` of the converted object, as JSON: a sparse spec
(status) of the version it came from.  Here a service (component, spec remainder, status) that does
not map back exactly is kept whole, and taken back only while the converted object still says what it
said when converted; after an edit the edited fields win and only fields with no counterpart come
back.  Conversion consumes these annotations wherever they appear.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError

from dynamo_snapshot.api.dgd_podtemplate import (
    POD_KEYS,
    pod_template_from_service,
    pod_template_to_service,
)
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import ComponentType, DynamoGraphDeploymentV1Beta1
from dynamo_snapshot.api.kube import KubeModel
from dynamo_snapshot.api.protocol import (
    ANNOTATION_DGD_SPEC,
    ANNOTATION_DGD_STATUS,
    API_GROUP,
    API_VERSION,
    API_VERSION_V1BETA1,
)

__all__ = [
    "V1ALPHA1",
    "V1BETA1",
    "ConversionError",
    "ConversionRequest",
    "ConversionResponse",
    "ConversionResult",
    "ConversionReview",
    "convert_object",
    "convert_review",
    "to_v1alpha1",
    "to_v1beta1",
]

V1ALPHA1 = f"{API_GROUP}/{API_VERSION}"
V1BETA1 = f"{API_GROUP}/{API_VERSION_V1BETA1}"
_KIND = "DynamoGraphDeployment"
_REVIEW_API_VERSION = "apiextensions.k8s.io/v1"

Json = dict[str, Any]
_Convert = Callable[[Json], Json]


class ConversionError(ValueError):
    """An object that cannot be converted; the message says why."""


# --- one service <-> one component ----------------------------------------------------------------
_EXPERIMENTAL_ENABLED = ("gpuMemoryService", "failover")
# v1alpha1 service fields with no v1beta1 counterpart (Dynamo keeps them in nvidia.com/dgd-spec).
_ALPHA_ONLY = ("serviceName", "annotations", "labels", "dynamoNamespace", "autoscaling", "ingress")
_BETA_ONLY = ("frontendSidecar", "dynamoSidecar")
_ALPHA_MAPPED = frozenset(
    (*POD_KEYS, *_EXPERIMENTAL_ENABLED, *_ALPHA_ONLY, "frontendSidecar", "componentType")
) | {"subComponentType", "sharedMemory", "scalingAdapter", "checkpoint"}
_BETA_MAPPED = frozenset((*_BETA_ONLY, "name", "type", "podTemplate", "experimental")) | {
    "sharedMemorySize",
    "compilationCache",
    "scalingAdapter",
}
_PROMOTED = ("prefill", "decode")
# v1beta1's type is an enum; a v1alpha1 componentType outside it (v1alpha1 takes any string) is kept with
# the whole service in nvidia.com/dgd-spec, so the v1beta1 object stays one v1beta1 admits.
_BETA_TYPES = frozenset(t.value for t in ComponentType)


def _carried(source: Json) -> Json:
    """The keys both versions spell alike: neither mapped by one nor a mapped name of the other."""
    return {k: copy.deepcopy(v) for k, v in source.items() if k not in _ALPHA_MAPPED | _BETA_MAPPED}


def _service_to_component(name: str, service: Json) -> Json:
    component: Json = {"name": name, **_carried(service)}
    kind, sub = service.get("componentType"), service.get("subComponentType")
    if kind == "worker" and sub in _PROMOTED:
        component["type"] = sub
    elif kind in _BETA_TYPES:
        component["type"] = kind
    template = pod_template_from_service(service)
    if template is not None:
        component["podTemplate"] = template
    experimental: Json = {}
    for key in _EXPERIMENTAL_ENABLED:
        value = service.get(key)
        if isinstance(value, dict) and value.get("enabled") is True:
            experimental[key] = {k: copy.deepcopy(v) for k, v in value.items() if k != "enabled"}
    if "checkpoint" in service:
        experimental["checkpoint"] = copy.deepcopy(service["checkpoint"])
    if experimental:
        component["experimental"] = experimental
    shared_memory = service.get("sharedMemory")
    if isinstance(shared_memory, dict):
        if shared_memory.get("disabled") is True:
            component["sharedMemorySize"] = "0"
        elif shared_memory.get("size"):
            component["sharedMemorySize"] = shared_memory["size"]
    cache = next((m for m in service.get("volumeMounts") or [] if _is_cache_mount(m)), None)
    if cache is not None:
        component["compilationCache"] = {
            "pvcName": cache.get("name"),
            **({"mountPath": cache["mountPoint"]} if cache.get("mountPoint") else {}),
        }
    adapter = service.get("scalingAdapter")
    if isinstance(adapter, dict) and adapter.get("enabled") is True:
        component["scalingAdapter"] = {k: copy.deepcopy(v) for k, v in adapter.items() if k != "enabled"}
    return component


def _is_cache_mount(mount: Any) -> bool:
    return isinstance(mount, dict) and mount.get("useAsCompilationCache") is True


def _component_to_service(component: Json) -> Json:
    service = _carried(component)
    kind = component.get("type")
    if kind in _PROMOTED:
        service["componentType"], service["subComponentType"] = "worker", kind
    elif kind is not None:
        service["componentType"] = kind
    if isinstance(component.get("podTemplate"), dict):
        pod_template_to_service(component["podTemplate"], service)
    experimental = component.get("experimental")
    if isinstance(experimental, dict):
        for key in _EXPERIMENTAL_ENABLED:
            if isinstance(experimental.get(key), dict):
                service[key] = {"enabled": True, **copy.deepcopy(experimental[key])}
        if "checkpoint" in experimental:
            service["checkpoint"] = copy.deepcopy(experimental["checkpoint"])
    size = component.get("sharedMemorySize")
    if size is not None:
        service["sharedMemory"] = {"disabled": True} if size in ("0", 0) else {"size": size}
    cache = component.get("compilationCache")
    if isinstance(cache, dict):
        mount = {"name": cache.get("pvcName"), "useAsCompilationCache": True}
        if cache.get("mountPath"):
            mount["mountPoint"] = cache["mountPath"]
        service["volumeMounts"] = [*service.get("volumeMounts", []), mount]
    adapter = component.get("scalingAdapter")
    if isinstance(adapter, dict):
        service["scalingAdapter"] = {"enabled": True, **copy.deepcopy(adapter)}
    return service


# --- spec and status outside the services ------------------------------------------------------------
_TOPOLOGY = ("topologyProfile", "clusterTopologyName")


def _rename(source: Json, pairs: tuple[tuple[str, str], ...], dropped: tuple[str, ...]) -> Json:
    """Copies ``source`` with keys renamed; ``dropped`` (and names the renames produce) not carried."""
    targets = {new for _, new in pairs}
    out = {k: copy.deepcopy(v) for k, v in source.items() if k not in dropped and k not in targets}
    for old, new in pairs:
        if old in source:
            out[new] = out.pop(old, None) if old in out else copy.deepcopy(source[old])
    return out


def _rest_to_beta(rest: Json) -> Json:
    out = _rename(rest, (("envs", "env"),), ("pvcs", "components"))
    if isinstance(out.get("topologyConstraint"), dict):
        out["topologyConstraint"] = _rename(out["topologyConstraint"], (_TOPOLOGY,), ())
    return out


def _rest_to_alpha(rest: Json) -> Json:
    out = _rename(rest, (("env", "envs"),), ("pvcs", "services"))
    if isinstance(out.get("topologyConstraint"), dict):
        out["topologyConstraint"] = _rename(out["topologyConstraint"], (_TOPOLOGY[::-1],), ())
    return out


def _replica_status(entry: Any, to_beta: bool) -> Any:
    if not isinstance(entry, dict):
        return copy.deepcopy(entry)
    out = copy.deepcopy(entry)
    if to_beta:
        name = out.pop("componentName", None)
        if name and not out.get("componentNames"):
            out["componentNames"] = [name]
    elif out.get("componentNames"):
        out["componentName"] = out["componentNames"][-1]
    return out


def _status_convert(status: Json, to_beta: bool) -> Json:
    old, new = ("services", "components") if to_beta else ("components", "services")
    out = _rename(status, (), (new,))
    if isinstance(out.get(old), dict):
        out[new] = {k: _replica_status(v, to_beta) for k, v in out.pop(old).items()}
    rolling = out.get("rollingUpdate")
    if isinstance(rolling, dict):
        pair = ("updatedServices", "updatedComponents")
        out["rollingUpdate"] = _rename(rolling, (pair if to_beta else pair[::-1],), ())
    return out


def _status_to_beta(status: Json) -> Json:
    return _status_convert(status, to_beta=True)


def _status_to_alpha(status: Json) -> Json:
    return _status_convert(status, to_beta=False)


def _restore(converted: Json, saved: Any, back: _Convert, source: Json, only: tuple[str, ...]) -> Json:
    """``saved`` when it still converts to ``source``; else ``converted`` plus the ``only`` keys of it."""
    if not isinstance(saved, dict):
        return converted
    if back(saved) == source:
        return copy.deepcopy(saved)
    extra = {k: copy.deepcopy(v) for k, v in saved.items() if k in only and k not in converted}
    return {**converted, **extra}


# --- whole objects --------------------------------------------------------------------------------------
def _checked(obj: Any, api_version: str) -> Json:
    if not isinstance(obj, dict):
        raise ConversionError(f"a {_KIND} must be a JSON object, not {type(obj).__name__}")
    if obj.get("kind") != _KIND:
        raise ConversionError(f"kind {obj.get('kind')!r} is not {_KIND}")
    if obj.get("apiVersion") != api_version:
        raise ConversionError(f"apiVersion {obj.get('apiVersion')!r} is not {api_version}")
    for key in ("metadata", "spec", "status"):
        if key in obj and not isinstance(obj[key], dict):
            raise ConversionError(f"{key} must be an object")
    annotations = obj.get("metadata", {}).get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        raise ConversionError("metadata.annotations must be a map of strings")
    return copy.deepcopy(obj)


def _pop_stash(metadata: Json, key: str) -> Json:
    """The JSON kept under annotation ``key``, removed; {} when absent or unreadable (as Dynamo)."""
    annotations = metadata.get("annotations")
    if not isinstance(annotations, dict) or key not in annotations:
        return {}
    raw = annotations.pop(key)
    if not annotations:
        del metadata["annotations"]
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _put_stash(obj: Json, key: str, value: Json) -> None:
    if value:
        metadata = obj.setdefault("metadata", {})
        annotations = metadata.setdefault("annotations", {})
        annotations[key] = json.dumps(value, separators=(",", ":"), sort_keys=True)


def _convert(obj: Json, api_version: str, spec: Callable[[Json, Json], tuple[Json, Json]]) -> Json:
    out = {k: v for k, v in obj.items() if k not in ("spec", "status")}
    out["apiVersion"] = api_version
    metadata = out.get("metadata", {})
    spec_stash, status_stash = (
        _pop_stash(metadata, ANNOTATION_DGD_SPEC),
        _pop_stash(metadata, ANNOTATION_DGD_STATUS),
    )
    to_beta = api_version == V1BETA1
    forward, back = (_status_to_beta, _status_to_alpha) if to_beta else (_status_to_alpha, _status_to_beta)
    if "spec" in obj:
        out["spec"], new_spec_stash = spec(obj["spec"], spec_stash)
        _put_stash(out, ANNOTATION_DGD_SPEC, new_spec_stash)
    if "status" in obj:
        status = obj["status"]
        out["status"] = _restore(forward(status), status_stash or None, back, status, ())
        if back(out["status"]) != status:
            _put_stash(out, ANNOTATION_DGD_STATUS, status)
    return out


def _spec_to_beta(spec: Json, stash: Json) -> tuple[Json, Json]:
    services = spec.get("services")
    rest = {k: v for k, v in spec.items() if k != "services"}
    saved_rest = {k: v for k, v in stash.items() if k != "components"}
    beta = _restore(_rest_to_beta(rest), saved_rest or None, _rest_to_alpha, rest, ())
    kept: Json = copy.deepcopy(rest) if _rest_to_alpha(beta) != rest else {}
    if services is None:
        return beta, kept
    if not isinstance(services, dict):
        raise ConversionError("spec.services must be a map from service name to service")
    saved = [
        c for c in stash.get("components") or [] if isinstance(c, dict) and isinstance(c.get("name"), str)
    ]
    by_name = {c["name"]: c for c in saved}
    order = [n for n in by_name if n in services] + sorted(n for n in services if n not in by_name)
    components: list[Json] = []
    kept_services: dict[str, Json | None] = {}
    for name in order:
        service = services[name]
        if service is None:
            kept_services[name] = None
            continue
        if not isinstance(service, dict):
            raise ConversionError(f"spec.services.{name} must be an object")
        component = _service_to_component(name, service)
        component = _restore(component, by_name.get(name), _component_to_service, service, _BETA_ONLY)
        if _component_to_service(component) != service:
            kept_services[name] = copy.deepcopy(service)
        components.append(component)
    beta["components"] = components
    if kept_services:
        kept["services"] = kept_services
    return beta, kept


def _components(spec: Json) -> list[Json]:
    components = spec.get("components")
    if not isinstance(components, list):
        raise ConversionError("spec.components must be a list of components")
    names: set[str] = set()
    for index, component in enumerate(components):
        name = component.get("name") if isinstance(component, dict) else None
        if not isinstance(name, str) or not name:
            raise ConversionError(f"spec.components[{index}] has no name: every component needs one")
        if name in names:
            raise ConversionError(f"spec.components has two components named {name!r}: names are unique")
        names.add(name)
    return components


def _spec_to_alpha(spec: Json, stash: Json) -> tuple[Json, Json]:
    rest = {k: v for k, v in spec.items() if k != "components"}
    saved_rest = {k: v for k, v in stash.items() if k != "services"}
    alpha = _restore(_rest_to_alpha(rest), saved_rest or None, _rest_to_beta, rest, ("pvcs",))
    kept: Json = copy.deepcopy(rest) if _rest_to_beta(alpha) != rest else {}
    if "components" not in spec:
        return alpha, kept
    components = _components(spec)
    saved: Json = stash["services"] if isinstance(stash.get("services"), dict) else {}
    services: Json = {}
    entries: list[Json] = []
    for component in components:
        name = component["name"]
        service = _component_to_service(component)
        forward = functools.partial(_service_to_component, name)
        service = _restore(service, saved.get(name), forward, component, _ALPHA_ONLY)
        services[name] = service
        mismatch = forward(service) != component
        entries.append(copy.deepcopy(component) if mismatch else {"name": name})
    services.update({n: None for n, s in saved.items() if s is None and n not in services})
    # Kept whole, in order: the names give the list's order back, the full entries their content.
    names = [c["name"] for c in components]
    if names != sorted(names) or any(len(e) > 1 for e in entries):
        kept["components"] = entries
    alpha["services"] = services
    return alpha, kept


def to_v1beta1(dgd: Json) -> Json:
    """A v1alpha1 DynamoGraphDeployment (JSON) as v1beta1; ConversionError when it is not one."""
    return _convert(_checked(dgd, V1ALPHA1), V1BETA1, _spec_to_beta)


def to_v1alpha1(dgd: Json) -> Json:
    """A v1beta1 DynamoGraphDeployment (JSON) as v1alpha1; ConversionError when it is not one."""
    return _convert(_checked(dgd, V1BETA1), V1ALPHA1, _spec_to_alpha)


# --- the conversion webhook's review ------------------------------------------------------------------
_MODELS = {V1ALPHA1: DynamoGraphDeployment, V1BETA1: DynamoGraphDeploymentV1Beta1}
_CONVERTERS: dict[str, _Convert] = {V1ALPHA1: to_v1alpha1, V1BETA1: to_v1beta1}


class ConversionRequest(KubeModel):
    uid: str = Field(min_length=1)
    desired_api_version: str = Field(alias="desiredAPIVersion")
    objects: list[Json] = Field(default_factory=list)


class ConversionResult(KubeModel):
    status: Literal["Success", "Failure"]
    message: str | None = None


class ConversionResponse(KubeModel):
    uid: str
    converted_objects: list[Json] | None = None
    result: ConversionResult


class ConversionReview(KubeModel):
    """apiextensions.k8s.io/v1 ConversionReview: the apiserver's request, this webhook's response."""

    api_version: Literal["apiextensions.k8s.io/v1"] = "apiextensions.k8s.io/v1"
    kind: Literal["ConversionReview"] = "ConversionReview"
    request: ConversionRequest | None = None
    response: ConversionResponse | None = None


def _errors(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(object)'}: {e['msg']}" for e in error.errors())


def _unserved(version: str) -> str:
    return f"desiredAPIVersion {version!r} is not served for {_KIND}: use {V1ALPHA1} or {V1BETA1}"


def convert_object(obj: Any, desired_api_version: str) -> Json:
    """``obj`` validated by its version's model and converted; ConversionError says what is wrong."""
    if desired_api_version not in _CONVERTERS:
        raise ConversionError(_unserved(desired_api_version))
    source = obj.get("apiVersion") if isinstance(obj, dict) else None
    if source not in _MODELS:
        raise ConversionError(f"apiVersion {source!r} is not a {_KIND} version: {V1ALPHA1} or {V1BETA1}")
    try:
        _MODELS[source].model_validate(obj)
    except ValidationError as error:
        raise ConversionError(_errors(error)) from None
    if source == desired_api_version:
        return _checked(obj, source)
    return _CONVERTERS[desired_api_version](obj)


def _label(index: int, obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    metadata = metadata if isinstance(metadata, dict) else {}
    where = "/".join(str(p) for p in (metadata.get("namespace"), metadata.get("name")) if p)
    return f"objects[{index}]" + (f" ({where})" if where else "")


def _respond(uid: str, converted: list[Json] | None, failure: str | None = None) -> Json:
    if failure is None:
        response = ConversionResponse(
            uid=uid, converted_objects=converted or [], result=ConversionResult(status="Success")
        )
    else:
        response = ConversionResponse(uid=uid, result=ConversionResult(status="Failure", message=failure))
    return ConversionReview(response=response).to_dict() | {
        "apiVersion": _REVIEW_API_VERSION,
        "kind": "ConversionReview",
    }


def convert_review(review: Any) -> Json:
    """The ConversionReview answering ``review``: every object converted, or a Failure saying why.

    Pure and total: bad input of any shape is answered, never raised.
    """
    request = review.get("request") if isinstance(review, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    uid = uid if isinstance(uid, str) else ""
    # The apiserver sends an empty response beside its request ({"uid": "", "result": {"metadata": {}}}).
    asked = {k: v for k, v in review.items() if k != "response"} if isinstance(review, dict) else review
    try:
        parsed = ConversionReview.model_validate(asked)
    except ValidationError as error:
        return _respond(
            uid, None, f"not an apiextensions.k8s.io/v1 ConversionReview request: {_errors(error)}"
        )
    if parsed.request is None:
        return _respond(uid, None, "the ConversionReview has no request")
    desired = parsed.request.desired_api_version
    if desired not in _CONVERTERS:
        return _respond(uid, None, _unserved(desired))
    converted = []
    for index, obj in enumerate(parsed.request.objects):
        try:
            converted.append(convert_object(obj, parsed.request.desired_api_version))
        except ConversionError as error:
            return _respond(uid, None, f"{_label(index, obj)}: {error}")
        except Exception as error:
            return _respond(
                uid, None, f"{_label(index, obj)}: conversion failed: {type(error).__name__}: {error}"
            )
    return _respond(uid, converted)
