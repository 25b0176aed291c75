"""Generate what names the node agent's settings from their model (dynamo_snapshot.agent.config):
agent/config.yaml (the image's defaults), the Helm chart's ConfigMap template of the agent and the agent
settings' entries of its values.schema.json, and the settings' rows of agent/README.md's flag table
(their meaning column is the README's own prose; a new setting starts with its description).

Output is deterministic, so a drift check compares it byte for byte.

    python -m dynamo_snapshot.cli.agent_configgen            # write the files
    python -m dynamo_snapshot.cli.agent_configgen --check    # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ByteSize
from pydantic.alias_generators import to_camel

from dynamo_snapshot.agent.config import AgentConfig, settings_fields
from dynamo_snapshot.cli.settings_flags import flag_name, setting_default

__all__ = ["CHART", "ChartValue", "main", "render", "stale_files", "write_files"]

CHART_DIR = Path("helm/dynamo-snapshot")
CONFIG_YAML = Path("agent/config.yaml")
CONFIGMAP = CHART_DIR / "templates/agent-configmap.yaml"
VALUES_SCHEMA = CHART_DIR / "values.schema.json"
README = Path("agent/README.md")
COMMAND = "python -m dynamo_snapshot.cli.agent_configgen"

_ABSOLUTE_PATH = {"type": "string", "pattern": "^/", "minLength": 2}
_QUANTITY = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([KMGT]i?)$"}


@dataclass(frozen=True)
class ChartValue:
    """Where the chart takes a setting from: ``path`` under ``.Values`` (None: not from the chart),
    constraints of the chart's own over the model's, and the config.yaml lines where not ``key: value``."""

    path: str | None
    schema: dict[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()


def _agent(name: str) -> ChartValue:
    return ChartValue(f"agent.{to_camel(name)}")


# Where a setting's value is not agent.<settingName>, or the chart says more of it.
CHART: dict[str, ChartValue] = {
    "node_name": ChartValue(None),  # $NODE_NAME, from the downward API
    "criu": ChartValue(
        "agent.criu",
        {
            "type": "string",
            "pattern": "^(/.+)?$",
            "minLength": 0,
            "description": "criu binary; empty: the image's",
        },
        ("{{- with $a.criu }}", "criu: {{ . | quote }}", "{{- end }}"),
    ),
    "runc_root": ChartValue("agent.containerRuntime.runcRoot"),
    "host_binds": ChartValue(
        "agent.hostBinds",
        {
            "$ref": "#/$defs/bindPaths",
            "description": "runc + launchWorkloads: host directories the workers see read-only (beside "
            "the image's /usr, /etc and /opt), mounted into the agent",
        },
        (
            "{{- with $a.hostBinds }}",
            'hostBinds: {{ concat (include "dynamo-snapshot.imageBinds" $ | fromJsonArray) . | toJson }}',
            "{{- end }}",
        ),
    ),
    "writable_binds": ChartValue(
        "agent.writableBinds",
        {
            "$ref": "#/$defs/bindPaths",
            "description": "runc + launchWorkloads: host directories the workers may write (none inside "
            "a read-only one), mounted into the agent",
        },
    ),
    "artifact_root": ChartValue("artifacts.mountPath"),
    "restore_scratch": ChartValue(
        "agent.restoreScratch.path",
        {
            "description": "where the agent sees the memory-backed emptyDir restores unpack compressed "
            "pages into"
        },
    ),
    "cache_root": ChartValue(
        "agent.cache.hostPath",
        {
            "description": "the node directory of the copies, with cache.enabled or storage.type s3 (mounted "
            "into the agent at the same path); not the artifacts directory"
        },
        lines=(
            '{{- if include "dynamo-snapshot.agentCache" . }}',
            "cacheRoot: {{ $a.cache.hostPath | quote }}",
            "{{- end }}",
        ),
    ),
    "cache_max_size": ChartValue("agent.cache.maxSize"),
    "cache_min_free": ChartValue("agent.cache.minFree"),
    # storage.type s3: the object store, its credentials the Secret the DaemonSet mounts at the default.
    "s3_endpoint": ChartValue(
        "storage.s3.endpoint",
        {"type": "string", "pattern": "^(https?://[^/\\s]+/?)?$", "description": "http(s)://host[:port]"},
        (
            '{{- if eq .Values.storage.type "s3" }}',
            's3Endpoint: {{ required "storage.type s3 needs storage.s3.endpoint" .Values.storage.s3.endpoint '
            "| quote }}",
            "{{- end }}",
        ),
    ),
    "s3_bucket": ChartValue("storage.s3.bucket"),
    "s3_prefix": ChartValue("storage.s3.prefix"),
    "s3_region": ChartValue("storage.s3.region"),
    "s3_ca_bundle": ChartValue(
        None,
        lines=(
            "{{- if .Values.storage.s3.caBundle.configMap }}",
            's3CaBundle: {{ printf "/var/run/secrets/dynamo-snapshot/s3-ca/%s" '
            ".Values.storage.s3.caBundle.key | quote }}",
            "{{- end }}",
        ),
    ),
    "s3_credentials_dir": ChartValue(None),
    "s3_parallel": ChartValue("storage.s3.parallel"),
    "s3_prefetch": ChartValue("storage.s3.prefetch"),
    "s3_stream_pages": ChartValue("storage.s3.streamPages"),
    "s3_stream_weights": ChartValue("storage.s3.streamWeights"),
    # The probes need it.
    "health_port": ChartValue("agent.healthPort", {"minimum": 1}),
}


def chart_value(name: str) -> ChartValue:
    return CHART.get(name) or _agent(name)


def _template_ref(path: str) -> str:
    return "$a" + path.removeprefix("agent") if path.startswith("agent.") else ".Values." + path


def _annotation(model: type[BaseModel], name: str) -> Any:
    annotation = model.model_fields[name].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) in (typing.Union, type(Path | None)) else annotation


def _config_line(model: type[BaseModel], name: str) -> tuple[str, ...]:
    value = chart_value(name)
    if value.lines or value.path is None:
        return value.lines
    ref, annotation = _template_ref(value.path), _annotation(model, name)
    if annotation is bool or annotation is float:
        rendered = f"{{{{ {ref} }}}}"
    elif annotation is int:
        rendered = f"{{{{ int {ref} }}}}"
    elif typing.get_origin(annotation) is list:
        rendered = f"{{{{ toJson {ref} }}}}"
    else:
        rendered = f"{{{{ {ref} | quote }}}}"
    return (f"{to_camel(name)}: {rendered}",)


def render_configmap() -> str:
    lines = [
        "{{- $a := .Values.agent -}}",
        f"# Generated by {COMMAND}:",
        "# edit dynamo_snapshot/agent/config.py, not this file.",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        '  name: {{ include "dynamo-snapshot.componentName" (dict "root" . "component" "agent") }}',
        "  namespace: {{ .Release.Namespace }}",
        "  labels:",
        '    {{- include "dynamo-snapshot.labels" (dict "root" . "component" "agent") | nindent 4 }}',
        "data:",
        "  # agent/config.yaml's keys (unknown keys are rejected at start). nodeName comes from $NODE_NAME,",
        "  # set from the downward API.",
        "  config.yaml: |",
    ]
    section = None
    for name_of_section, name, model in settings_fields():
        rendered = _config_line(model, name)
        if not rendered:
            continue
        if name_of_section != section:
            section = name_of_section
            lines.append(f"    {section}:")
        lines += [f"      {line}" for line in rendered]
    return "\n".join(lines) + "\n"


def _yaml_default(model: type[BaseModel], name: str) -> str | None:
    """The setting's default as config.yaml writes it; None where it has none there."""
    info = model.model_fields[name]
    if info.default_factory is not None and name == "node_name":
        return None
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        return _quantity(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    if isinstance(value, str) and value.lower() in _YAML_NOT_STRINGS:
        return json.dumps(value)  # a YAML reader would take the bare word for a boolean or null
    return str(value)


_YAML_NOT_STRINGS = frozenset({"on", "off", "yes", "no", "y", "n", "true", "false", "null", "~"})


def _quantity(n: int) -> str:
    for shift, unit in ((40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def render_config_yaml() -> str:
    lines = [
        "# The node agent's default settings, baked into its image; flags override them.",
        f"# Generated by {COMMAND}",
        "# from dynamo_snapshot/agent/config.py: edit the model, not this file.",
        "# A setting may also be given by its name alone, outside its section (compressPages: true).",
    ]
    for section, info in AgentConfig.model_fields.items():
        model = info.annotation
        assert isinstance(model, type)
        assert issubclass(model, BaseModel)
        doc = " ".join((model.__doc__ or section).split())
        lines += ["", *textwrap.wrap(doc, 108, initial_indent="# ", subsequent_indent="# "), f"{section}:"]
        for name, field_info in model.model_fields.items():
            text = f"{field_info.description} ({flag_name(name)})"
            lines += textwrap.wrap(
                text, 106, initial_indent="  # ", subsequent_indent="  #   ", break_on_hyphens=False
            )
            default = _yaml_default(model, name)
            key = to_camel(name)
            lines.append(f"  {key}: {default}" if default is not None else f"  # {key}:")
    return "\n".join(lines) + "\n"


def _leaf_schema(model: type[BaseModel], name: str) -> dict[str, Any]:
    """The setting's schema in the chart's values: the model's, with the chart's own constraints over it."""
    prop = model.model_json_schema(by_alias=True)["properties"][to_camel(name)]
    prop = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
    annotation = _annotation(model, name)
    schema: dict[str, Any]
    if annotation is Path:
        schema = dict(_ABSOLUTE_PATH)
    elif annotation is ByteSize:
        schema = dict(_QUANTITY)
    else:
        keep = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items")
        schema = {k: prop[k] for k in keep if k in prop}
    if model.model_fields[name].description:
        schema["description"] = model.model_fields[name].description
    own = chart_value(name).schema
    # A reference is the whole schema (draft-07 reads nothing beside it but the description).
    return dict(own) if "$ref" in own else {**schema, **own}


def render_values_schema(current: str) -> str:
    """``current`` (values.schema.json) with every agent setting's entry at its value's path."""
    schema = json.loads(current)
    for _, name, model in settings_fields():
        path = chart_value(name).path
        if path is None:
            continue
        node = schema
        *parents, leaf = path.split(".")
        for part in parents:
            node = node["properties"][part]
        node.setdefault("properties", {})[leaf] = _leaf_schema(model, name)
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


_ROW = re.compile(r"^\| `(--[a-z-]+)[^`]*`(?: / `--no-[a-z-]+`)? \|[^|]*\|(?:[^|]*\|)? (.*) \|$")
_TABLE_HEAD = "| flag | default | config.yaml key · chart value | meaning |"


def _doc_default(name: str) -> str:
    special = {
        "node_name": "`$NODE_NAME`",
        "criu": "`$DYNSNAP_CRIU`, then PATH",
        "cache_root": "unset (no cache)",
        "s3_endpoint": "unset (no object store)",
        "s3_ca_bundle": "unset (the system's CAs)",
    }
    if name in special:
        return special[name]
    default = setting_default(name)
    if default in ("on", "off") or default is None:
        return default or "—"
    for _, setting, model in settings_fields():
        if setting == name:
            text = _yaml_default(model, name) or default
            return text if re.fullmatch(r"[0-9.]+", text) else f"`{text}`"
    raise KeyError(name)


def render_readme(current: str) -> str:
    """agent/README.md with the settings' rows of its flag table from the model (their meanings kept)."""
    lines = current.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| flag | default |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    meanings = {m[1]: m[2] for line in lines[start:end] if (m := _ROW.match(line))}
    rows = [_TABLE_HEAD, "|---|---|---|---|"]
    rows.append("| `--config FILE` | — | — | YAML settings (keys as in `config.yaml`) |")
    rows.append("| `--kubeconfig FILE` | in-cluster | — | API server credentials |")
    for section, name, model in settings_fields():
        flag = flag_name(name)
        shown = f"`{flag}` / `--no-{flag[2:]}`" if _annotation(model, name) is bool else f"`{flag}`"
        path = chart_value(name).path
        where = f"`{section}.{to_camel(name)}` · " + (f"`{path}`" if path else "—")
        meaning = meanings.get(flag) or model.model_fields[name].description or ""
        rows.append(f"| {shown} | {_doc_default(name)} | {where} | {meaning} |")
    rows.append("| `--log-level` | `info` | — · `agent.logLevel` | `debug`, `info`, `warning` or `error` |")
    return "\n".join([*lines[:start], *rows, *lines[end:]]) + "\n"


_FILES: dict[Path, Callable[[str], str]] = {
    CONFIG_YAML: lambda _: render_config_yaml(),
    CONFIGMAP: lambda _: render_configmap(),
    VALUES_SCHEMA: render_values_schema,
    README: render_readme,
}


def render(root: Path) -> dict[Path, str]:
    """Every generated file (relative to ``root``) as the model makes it."""
    return {path: make((root / path).read_text(encoding="utf-8")) for path, make in _FILES.items()}


def write_files(root: Path) -> list[Path]:
    changed = []
    for path, text in render(root).items():
        target = root / path
        if target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def stale_files(root: Path) -> list[str]:
    """Why the files differ from the generator's output, one line per file; empty when current."""
    return [
        f"{path}: differs from the agent's settings model"
        for path, text in render(root).items()
        if (root / path).read_text(encoding="utf-8") != text
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Generate (or check) what names the agent's settings from their model."
    )
    parser.add_argument("--root", type=Path, default=Path(), help="the repository (default: .)")
    parser.add_argument("--check", action="store_true", help="only check that the files are current")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_files(args.root)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        if problems:
            print(f"Regenerate them with: {COMMAND}", file=sys.stderr)
            return 1
        print("The agent's generated settings files are up to date.")
        return 0
    for path in write_files(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
