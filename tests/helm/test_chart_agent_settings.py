"""Every agent setting can be set from the chart: a value other than the model's default at the setting's
chart value (agent_configgen.CHART) reaches the agent's config as rendered into its ConfigMap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ByteSize

from dynamo_snapshot.agent.config import AgentConfig, settings_fields
from dynamo_snapshot.agent.runtime.runc import DEFAULT_HOST_BINDS
from dynamo_snapshot.cli.agent_configgen import chart_value
from tests.helm.chart import one, render

# Values no default has, by setting, where its type alone does not give one.
OTHER: dict[str, Any] = {
    "runtime": "runc",  # launchWorkloads needs it
    "host_binds": ["/data/ro"],
    "writable_binds": ["/data/rw"],
    "criu": "/opt/criu/bin/criu",
    "metrics_port": 9191,
    "health_port": 8383,
    "s3_endpoint": "https://s3.example:9000",
    "s3_bucket": "other-bucket",
    "s3_prefix": "team-a/",
    "s3_region": "eu-west-1",
    "s3_parallel": 12,
    "s3_prefetch": "all",
    "restore_readers": 4,
    "drop_zero_pages": "on",
}


def _other(name: str, default: Any) -> Any:
    if name in OTHER:
        return OTHER[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, ByteSize):
        return f"{int(default) // (1 << 30) + 1}Gi"
    if isinstance(default, int | float):  # timeouts, seconds (ports are above)
        return default + 1.5
    if isinstance(default, Path) or default is None:
        return f"/srv/other/{name.replace('_', '-')}"
    raise AssertionError(f"no other value for {name} ({default!r})")


def _set(values: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        values = values.setdefault(part, {})
    values[leaf] = value


def test_every_agent_setting_reaches_the_agent_from_its_chart_value(monkeypatch: pytest.MonkeyPatch) -> None:
    values: dict[str, Any] = {
        "agent": {"cache": {"enabled": True}},
        "storage": {"type": "s3", "s3": {"credentialsSecret": "s3-credentials"}},
    }
    given: dict[tuple[str, str], Any] = {}
    for section, name, model in settings_fields():
        path = chart_value(name).path
        if path is None:
            continue
        value = _other(name, model.model_fields[name].get_default(call_default_factory=True))
        _set(values, path, value)
        given[section, name] = value
    cm = one(render(values), "ConfigMap", "-agent")
    monkeypatch.setenv("NODE_NAME", "gpu-0")
    config = AgentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    expected = AgentConfig.model_validate(
        {"node_name": "gpu-0", **{name: v for (_, name), v in given.items()}}
    )
    # The chart adds the image's system directories to the read-only binds it is given.
    expected.containers.host_binds = [*DEFAULT_HOST_BINDS, *OTHER["host_binds"]]
    assert config == expected
    for (section, name), _ in given.items():
        default = AgentConfig(node_name="gpu-0")
        assert getattr(getattr(config, section), name) != getattr(getattr(default, section), name), name
