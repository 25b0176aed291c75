"""helm/dynamo-snapshot/values-local.yaml: the chart's workloads run exactly the images built here
(localcluster/project_images.py), never pulled."""

from __future__ import annotations

from typing import Any

import yaml

from dynamo_snapshot_dev.localcluster.project_images import AGENT_REPOSITORY, CONTROLLER_REPOSITORY, LOCAL_TAG
from tests.helm.chart import CHART, helm, lint, one, render

VALUES_LOCAL = CHART / "values-local.yaml"


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_values_local_renders_both_workloads_with_the_images_built_here() -> None:
    values = yaml.safe_load(VALUES_LOCAL.read_text())
    linted = lint(values)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    objs = render(values)
    controller = _containers(one(objs, "Deployment", "-controller"))
    agent = _containers(one(objs, "DaemonSet", "-agent"))
    assert {c["name"] for c in agent} >= {"agent", "install-seccomp-profile"}
    assert [(c["image"], c["imagePullPolicy"]) for c in controller] == [
        (f"{CONTROLLER_REPOSITORY}:{LOCAL_TAG}", "Never")
    ]
    assert {(c["image"], c["imagePullPolicy"]) for c in agent} == {
        (f"{AGENT_REPOSITORY}:{LOCAL_TAG}", "Never")
    }


def test_values_local_is_passed_to_helm_as_a_file() -> None:
    """`helm template -f values-local.yaml`, as an install will run it: the same images."""
    proc = helm("template", "t", str(CHART), "--namespace", "ns1", "-f", str(VALUES_LOCAL))
    assert proc.returncode == 0, proc.stderr
    images = {
        (c["image"], c["imagePullPolicy"])
        for doc in yaml.safe_load_all(proc.stdout)
        if doc and doc["kind"] in ("Deployment", "DaemonSet")
        for c in _containers(doc)
    }
    assert images == {
        (f"{CONTROLLER_REPOSITORY}:{LOCAL_TAG}", "Never"),
        (f"{AGENT_REPOSITORY}:{LOCAL_TAG}", "Never"),
    }
