"""What names the agent's settings is exactly what the generator makes from their model: agent/config.yaml,
the chart's agent ConfigMap and values schema, agent/README.md's flag table; and the chart's values.yaml
gives every setting it renders the model's default."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot.agent.config import AgentConfig, settings_fields
from dynamo_snapshot.cli import agent_configgen

REPO = Path(__file__).resolve().parents[2]
GENERATED = [
    agent_configgen.CONFIG_YAML,
    agent_configgen.CONFIGMAP,
    agent_configgen.VALUES_SCHEMA,
    agent_configgen.README,
]


def test_generated_files_match_the_model() -> None:
    problems = agent_configgen.stale_files(REPO)
    assert problems == [], (
        "files out of date with dynamo_snapshot/agent/config.py; regenerate with "
        f"`{agent_configgen.COMMAND}`:\n" + "\n".join(problems)
    )


def _copy(tmp: Path) -> Path:
    for path in GENERATED:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / path, tmp / path)
    return tmp


def test_check_reports_drift_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    config = root / agent_configgen.CONFIG_YAML
    config.write_text(config.read_text().replace('dropZeroPages: "off"', 'dropZeroPages: "on"'))
    schema = root / agent_configgen.VALUES_SCHEMA
    schema.write_text(schema.read_text().replace('"dropZeroPages"', '"dropZeroPage"'))
    assert agent_configgen.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"{agent_configgen.CONFIG_YAML}: differs" in err
    assert f"{agent_configgen.VALUES_SCHEMA}: differs" in err
    assert agent_configgen.main(["--root", str(root)]) == 0
    assert agent_configgen.main(["--root", str(root), "--check"]) == 0
    assert config.read_text() == (REPO / agent_configgen.CONFIG_YAML).read_text()


def test_rendering_is_deterministic() -> None:
    assert agent_configgen.render(REPO) == agent_configgen.render(REPO)


def test_the_shipped_config_gives_every_setting_but_the_environments() -> None:
    shipped = yaml.safe_load((REPO / agent_configgen.CONFIG_YAML).read_text())
    for section, name, model in settings_fields():
        key = model.model_fields[name].alias or name
        if (
            model.model_fields[name].get_default(call_default_factory=True) in (None, "")
            or name == "node_name"
        ):
            assert key not in shipped[section], f"{section}.{key}"
        else:
            assert key in shipped[section], f"{section}.{key}"
    assert AgentConfig.model_validate({**shipped, "nodeName": "n"}) == AgentConfig(node_name="n")


def _value(values: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        values = values[part]
    return values


def test_the_chart_can_set_every_setting_and_defaults_to_the_models() -> None:
    values = yaml.safe_load((REPO / "helm" / "dynamo-snapshot" / "values.yaml").read_text())
    for section, name, model in settings_fields():
        chart = agent_configgen.chart_value(name)
        if chart.path is None:
            # $NODE_NAME, from the downward API; where the DaemonSet mounts the object store's Secret and
            # CA bundle (the CA's file name from storage.s3.caBundle.key).
            assert name in {"node_name", "s3_credentials_dir", "s3_ca_bundle"}
            continue
        given = _value(values, chart.path)
        if chart.lines:
            continue  # the chart's own rendering (an optional value, or one it adds to)
        info = model.model_fields[name]
        default = info.get_default(call_default_factory=True)
        read = getattr(getattr(AgentConfig.model_validate({"node_name": "n", name: given}), section), name)
        assert read == default, f"{chart.path}: {given!r} is not the model's {default!r}"
