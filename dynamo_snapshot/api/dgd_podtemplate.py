"""A v1alpha1 service's pod fields <-> a v1beta1 component's podTemplate, after Dynamo's conversion.

v1alpha1 spreads a worker's pod over resources, envs, envFromSecret, the two probes, volumeMounts,
extraPodMetadata and extraPodSpec (a PodSpec plus mainContainer); v1beta1 holds one PodTemplateSpec
whose container ``main`` carries them.  Both directions work on plain JSON dicts.  They are inverses
on the shapes Dynamo's own conversion round-trips; ``dgd_conversion`` keeps whatever else in its
annotations, so no direction here has to be perfect.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from dynamo_snapshot.api.protocol import DEFAULT_TARGET_CONTAINER, RESOURCE_GPU

__all__ = ["POD_KEYS", "pod_template_from_service", "pod_template_to_service"]

Json = dict[str, Any]

POD_KEYS = (
    "resources",
    "envs",
    "envFromSecret",
    "livenessProbe",
    "readinessProbe",
    "volumeMounts",
    "extraPodSpec",
    "extraPodMetadata",
)
_PROBES = ("livenessProbe", "readinessProbe")
_METADATA_KEYS = ("annotations", "labels")
_NAMED_RESOURCES = ("cpu", "memory")


def _item_to_native(item: Json) -> Json:
    native: Json = {}
    for key, value in item.items():
        if key in _NAMED_RESOURCES:
            native[key] = value
        elif key == "gpu":
            native[item.get("gpuType") or RESOURCE_GPU] = value
        elif key == "custom" and isinstance(value, dict):
            native.update(value)
        elif key not in ("gpuType", "custom"):
            native[key] = value
    return native


def _item_from_native(native: Json) -> Json:
    item: Json = {}
    custom: Json = {}
    for key, value in native.items():
        if key in _NAMED_RESOURCES:
            item[key] = value
        elif key == RESOURCE_GPU:
            item["gpu"] = value
        else:
            custom[key] = value
    if custom:
        item["custom"] = custom
    return item


def _map_sides(resources: Json, convert: Callable[[Json], Json]) -> Json:
    """``resources`` with its requests and limits converted, everything else copied as it is."""
    out: Json = {}
    for key, value in resources.items():
        is_side = key in ("requests", "limits") and isinstance(value, dict)
        out[key] = convert(value) if is_side else copy.deepcopy(value)
    return out


def _resources_to_native(resources: Json) -> Json:
    return _map_sides(resources, _item_to_native)


def _resources_from_native(native: Json) -> Json:
    return _map_sides(native, _item_from_native)


def _merge_env(base: list[Any], override: list[Any]) -> list[Any]:
    """mainContainer.env on top of envs, by name, as Dynamo's controller merges them."""
    merged = list(base)
    for entry in override:
        name = entry.get("name") if isinstance(entry, dict) else None
        index = next((i for i, e in enumerate(merged) if isinstance(e, dict) and e.get("name") == name), None)
        if index is None:
            merged.append(entry)
        else:
            merged[index] = entry
    return merged


def _is_cache_mount(mount: Any) -> bool:
    return isinstance(mount, dict) and mount.get("useAsCompilationCache") is True


def _main_from_dedicated(service: Json) -> Json:
    main: Json = {"name": DEFAULT_TARGET_CONTAINER}
    if isinstance(service.get("resources"), dict):
        main["resources"] = _resources_to_native(service["resources"])
    if service.get("envs"):
        main["env"] = copy.deepcopy(service["envs"])
    if service.get("envFromSecret"):
        main["envFrom"] = [{"secretRef": {"name": service["envFromSecret"]}}]
    for probe in _PROBES:
        if service.get(probe) is not None:
            main[probe] = copy.deepcopy(service[probe])
    mounts = [
        {"name": m.get("name"), **({"mountPath": m["mountPoint"]} if m.get("mountPoint") else {})}
        for m in service.get("volumeMounts") or []
        if isinstance(m, dict) and not _is_cache_mount(m)
    ]
    if mounts:
        main["volumeMounts"] = mounts
    return main


def pod_template_from_service(service: Json) -> Json | None:
    """The podTemplate a v1alpha1 service's pod fields make, or None when it sets none of them."""
    mounts = [m for m in service.get("volumeMounts") or [] if not _is_cache_mount(m)]
    if not any(k in service for k in POD_KEYS if k != "volumeMounts") and not mounts:
        return None
    template: Json = {}
    extra_metadata = service.get("extraPodMetadata")
    if isinstance(extra_metadata, dict):
        metadata = {k: copy.deepcopy(extra_metadata[k]) for k in _METADATA_KEYS if extra_metadata.get(k)}
        if metadata:
            template["metadata"] = metadata
    extra = service.get("extraPodSpec")
    extra = extra if isinstance(extra, dict) else {}
    spec = {k: copy.deepcopy(v) for k, v in extra.items() if k != "mainContainer"}
    main = _main_from_dedicated(service)
    override = extra.get("mainContainer")
    if isinstance(override, dict):
        for key, value in override.items():
            if key == "env" and isinstance(value, list):
                main["env"] = _merge_env(main.get("env", []), copy.deepcopy(value))
            elif key != "name":
                main[key] = copy.deepcopy(value)
    sidecars = [
        c for c in spec.get("containers") or [] if not (isinstance(c, dict) and c.get("name") == main["name"])
    ]
    spec["containers"] = [main, *sidecars]
    template["spec"] = spec
    return template


def _dedicated_from_main(main: Json, service: Json) -> None:
    """Moves what v1alpha1 has a field for out of ``main`` into ``service``."""
    if isinstance(main.get("resources"), dict):
        service["resources"] = _resources_from_native(main.pop("resources"))
    if isinstance(main.get("env"), list) and main["env"]:
        service["envs"] = main.pop("env")
    env_from = main.get("envFrom")
    if isinstance(env_from, list) and len(env_from) == 1 and isinstance(env_from[0], dict):
        secret = env_from[0].get("secretRef")
        if list(env_from[0]) == ["secretRef"] and isinstance(secret, dict) and list(secret) == ["name"]:
            service["envFromSecret"] = secret["name"]
            del main["envFrom"]
    for probe in _PROBES:
        if main.get(probe) is not None:
            service[probe] = main.pop(probe)
    mounts = main.get("volumeMounts")
    if isinstance(mounts, list) and mounts and all(_is_plain_mount(m) for m in mounts):
        service["volumeMounts"] = [
            {"name": m["name"], **({"mountPoint": m["mountPath"]} if "mountPath" in m else {})}
            for m in main.pop("volumeMounts")
        ]


def _is_plain_mount(mount: Any) -> bool:
    return isinstance(mount, dict) and "name" in mount and set(mount) <= {"name", "mountPath"}


def pod_template_to_service(template: Json, service: Json) -> None:
    """Spreads a v1beta1 podTemplate over the v1alpha1 fields of ``service``."""
    template = copy.deepcopy(template)
    metadata = template.get("metadata")
    if isinstance(metadata, dict):
        extra_metadata = {k: metadata[k] for k in _METADATA_KEYS if metadata.get(k)}
        if extra_metadata:
            service["extraPodMetadata"] = extra_metadata
    spec = template.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    containers = spec.get("containers")
    containers = containers if isinstance(containers, list) else []
    main_index = next(
        (
            i
            for i, c in enumerate(containers)
            if isinstance(c, dict) and c.get("name") == DEFAULT_TARGET_CONTAINER
        ),
        None,
    )
    extra: Json = {k: v for k, v in spec.items() if k != "containers"}
    sidecars = [c for i, c in enumerate(containers) if i != main_index]
    if sidecars:
        extra["containers"] = sidecars
    if main_index is not None:
        main = {k: v for k, v in containers[main_index].items() if k != "name"}
        _dedicated_from_main(main, service)
        if main:
            extra["mainContainer"] = main
    if extra:
        service["extraPodSpec"] = extra
