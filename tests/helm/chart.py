"""Render the chart with the real helm binary and pick objects out of the result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot_dev.localcluster.components import SETUP_HINT, cache_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dynamo-snapshot"
Obj = dict[str, Any]
# The restore webhook is on by default; these values turn it off (its generated certificate differs on
# every render, so renders meant to compare equal leave it out).
WEBHOOK_OFF: Obj = {"webhook": {"enabled": False}}


def helm_binary() -> Path:
    """The helm that scripts/test-env.sh caches (the pinned version), else one on PATH."""
    cached = cache_dir() / "bin" / "helm"
    if os.access(cached, os.X_OK):
        return cached
    found = shutil.which("helm")
    if not found:
        pytest.fail(f"helm is missing in {cached.parent} — {SETUP_HINT}", pytrace=False)
    return Path(found)


def helm(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def _values_args(values: Obj | None, tmp: Path) -> list[str]:
    if not values:
        return []
    path = tmp / "values.yaml"
    # JSON, a YAML subset with every string quoted: PyYAML leaves a string such as 86373e69 plain and
    # helm reads it as a number.
    path.write_text(json.dumps(values))
    return ["-f", str(path)]


def render_text(values: Obj | None = None, *, release: str = "t", namespace: str = "ns1") -> str:
    """`helm template` output; fails the test with helm's stderr when rendering fails."""
    proc = template(values, release=release, namespace=namespace)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return proc.stdout


def template(
    values: Obj | None = None, *, release: str = "t", namespace: str = "ns1"
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as tmp:
        args = _values_args(values, Path(tmp))
        return helm("template", release, str(CHART), "--namespace", namespace, *args)


def lint(values: Obj | None = None) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as tmp:
        return helm("lint", "--strict", str(CHART), *_values_args(values, Path(tmp)))


def render(values: Obj | None = None, *, release: str = "t", namespace: str = "ns1") -> list[Obj]:
    text = render_text(values, release=release, namespace=namespace)
    return [d for d in yaml.safe_load_all(text) if d]


def one(objs: Iterable[Obj], kind: str, name_suffix: str = "") -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (
        f"expected one {kind} named *{name_suffix}, found {[o['metadata'] for o in found]}"
    )
    return found[0]


def kinds(objs: Iterable[Obj]) -> list[str]:
    return sorted(o["kind"] for o in objs)


def rule_triples(role: Obj) -> set[tuple[str, str, str, str]]:
    """(apiGroup, resource, resourceName or "*", verb) for every combination a Role grants."""
    out = set()
    for rule in role["rules"]:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for name in rule.get("resourceNames") or ["*"]:
                    for verb in rule["verbs"]:
                        out.add((group, resource, name, verb))
    return out
