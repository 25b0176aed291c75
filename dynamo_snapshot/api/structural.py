"""Pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema.

The apiserver accepts only "structural" schemas: every node typed, no ``$ref``, no ``anyOf`` unions
of types, no ``additionalProperties`` beside ``properties``.  Pydantic emits all of those, so this
rewrites its output: references are inlined, ``X | None`` becomes plain ``X``, models that keep
unknown keys (``extra="allow"``) and free-form ``dict[str, Any]`` become
``x-kubernetes-preserve-unknown-fields``, and ``x-kubernetes-*`` extensions given in
``json_schema_extra`` pass through.  Anything it cannot express raises, naming the field, rather than
producing a CRD the apiserver would reject or silently prune.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

__all__ = ["PRESERVE_UNKNOWN", "structural_problems", "structural_schema"]

PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"
_VALIDATIONS = "x-kubernetes-validations"

# Keywords copied as they are; "title" and friends are documentation pydantic invents from names.
_PASSTHROUGH = frozenset(
    {
        "type",
        "description",
        "enum",
        "default",
        "format",
        "pattern",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "nullable",
    }
)
_DROPPED = frozenset({"title", "$schema", "examples", "readOnly", "writeOnly", "deprecated"})
_NULL = {"type": "null"}


def _merge(inner: Mapping[str, Any], outer: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay a field's own keywords (``outer``) on the schema it refers to (``inner``).

    Validation rules accumulate: a model's own CEL rules and the rules a field adds both apply.
    """
    merged = {**inner, **outer}
    if _VALIDATIONS in inner and _VALIDATIONS in outer:
        merged[_VALIDATIONS] = [*inner[_VALIDATIONS], *outer[_VALIDATIONS]]
    return merged


class _Converter:
    def __init__(self, definitions: Mapping[str, Any]) -> None:
        self._definitions = definitions

    def _flatten(self, node: Mapping[str, Any], path: str) -> dict[str, Any]:
        """Inline references and strip ``None`` from unions until the node stands on its own."""
        current = dict(node)
        while True:
            if "$ref" in current:
                name = current.pop("$ref").rsplit("/", 1)[-1]
                current = _merge(self._definitions[name], current)
            elif "allOf" in current:
                parts = current.pop("allOf")
                if len(parts) != 1:
                    raise ValueError(f"{path}: allOf with {len(parts)} schemas has no structural form")
                current = _merge(parts[0], current)
            elif "anyOf" in current or "oneOf" in current:
                union = "anyOf" if "anyOf" in current else "oneOf"
                options = [option for option in current.pop(union) if option != _NULL]
                if len(options) != 1:
                    raise ValueError(f"{path}: a union of {len(options)} schemas has no structural form")
                current = _merge(options[0], current)
            else:
                return current

    def convert(self, node: Mapping[str, Any], path: str) -> dict[str, Any]:
        flat = self._flatten(node, path)
        out: dict[str, Any] = {}
        for key, value in flat.items():
            if key in _DROPPED or (key == "default" and value is None):
                continue
            if key == "properties":
                out[key] = {name: self.convert(sub, f"{path}.{name}") for name, sub in value.items()}
            elif key == "additionalProperties":
                if value is True:
                    out[PRESERVE_UNKNOWN] = True
                elif value is not False:
                    out[key] = self.convert(value, f"{path}[*]")
            elif key == "items":
                out[key] = self.convert(value, f"{path}[]")
            elif key == "required":
                out[key] = sorted(value)
            elif key == "const":
                out["enum"] = [value]
            elif key in ("exclusiveMinimum", "exclusiveMaximum"):
                # OpenAPI v3.0 spells these as booleans beside minimum/maximum; JSON Schema as bounds.
                if flat.get("type") != "integer":
                    raise ValueError(f"{path}: {key} is only supported on integers; use ge/le")
                if key == "exclusiveMinimum":
                    out["minimum"] = value + 1
                else:
                    out["maximum"] = value - 1
            elif key in _PASSTHROUGH or key.startswith("x-kubernetes-"):
                # Copied so no two nodes share a list, which YAML would render as an anchor.
                out[key] = copy.deepcopy(value)
            else:
                raise ValueError(f"{path}: JSON Schema keyword {key!r} has no structural form")
        if "properties" in out and "additionalProperties" in out:
            raise ValueError(f"{path}: an object cannot have both declared and map-typed properties")
        return out


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of ``model`` as the API sees it (camelCase names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions = raw.pop("$defs", {})
    return _Converter(definitions).convert(raw, model.__name__)


def _walk(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), Mapping):
        yield from _walk(node["additionalProperties"], f"{path}[*]")
    if isinstance(node.get("items"), Mapping):
        yield from _walk(node["items"], f"{path}[]")


def structural_problems(schema: Mapping[str, Any], path: str = "<root>") -> list[str]:
    """Why the apiserver would refuse (or silently prune) this schema; empty when it is fine.

    Also flags a typed object that declares nothing and keeps nothing: the apiserver would prune
    every key from it, which is never what a model meant.  ``metadata`` at the root is the exception,
    the apiserver owns its schema.
    """
    problems: list[str] = []
    for where, node in _walk(schema, path):
        name = where
        for keyword in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs"):
            if keyword in node:
                problems.append(f"{name}: {keyword} is not allowed")
        preserved = node.get(PRESERVE_UNKNOWN) is True
        if "type" not in node and not preserved and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{name}: no type")
        if node.get("additionalProperties") is False:
            problems.append(f"{name}: additionalProperties: false is not allowed")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{name}: properties and additionalProperties together")
        bare_object = node.get("type") == "object" and not (
            "properties" in node or "additionalProperties" in node or preserved
        )
        if bare_object and where != f"{path}.metadata":
            problems.append(f"{name}: object declares no fields and keeps none; everything would be pruned")
    return problems
