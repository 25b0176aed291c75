"""`dynamo-snapshot dgd convert`: every DynamoGraphDeployment of the files converted as the conversion
webhook converts it, other documents as they are, a DGD that cannot be converted refused naming it."""

from __future__ import annotations

from pathlib import Path

import yaml

from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import DynamoGraphDeploymentV1Beta1
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
DIRECTORY = REPO / "examples" / "vllm"
UPSTREAM = REPO / "tests" / "api" / "fixtures" / "dgd_v1beta1" / "vllm-disagg.yaml"


def _docs(text: str) -> list[dict[str, object]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def test_a_directory_of_v1alpha1_manifests_is_written_at_v1beta1_and_back() -> None:
    files = sorted(str(p) for p in DIRECTORY.glob("*.yaml"))
    given = [d for f in files for d in _docs(Path(f).read_text(encoding="utf-8"))]
    proc = run_cli("dgd", "convert", *files)
    assert proc.returncode == 0, proc.stderr
    out = _docs(proc.stdout)
    assert [d["kind"] for d in out] == [d["kind"] for d in given]
    dgds = [d for d in out if d["kind"] == "DynamoGraphDeployment"]
    assert dgds, "the directory holds DGDs"
    for dgd in dgds:
        assert dgd["apiVersion"] == "nvidia.com/v1beta1"
        DynamoGraphDeploymentV1Beta1.model_validate(dgd)
    assert [d for d in out if d["kind"] != "DynamoGraphDeployment"] == [
        d for d in given if d["kind"] != "DynamoGraphDeployment"
    ]
    back = run_cli("dgd", "convert", "--to", "v1alpha1", "-", input=proc.stdout)
    assert back.returncode == 0, back.stderr
    assert _docs(back.stdout) == given


def test_an_upstream_v1beta1_manifest_converts_to_v1alpha1() -> None:
    proc = run_cli("dgd", "convert", "--to", "v1alpha1", str(UPSTREAM))
    assert proc.returncode == 0, proc.stderr
    [dgd] = _docs(proc.stdout)
    model = DynamoGraphDeployment.model_validate(dgd)
    assert set(model.spec.services or {}) == {"Frontend", "VllmDecodeWorker", "VllmPrefillWorker"}


def test_an_invalid_dgd_is_refused_naming_it_and_the_field(tmp_path: Path) -> None:
    bad = yaml.safe_load(UPSTREAM.read_text(encoding="utf-8"))
    bad["spec"]["components"][1]["replicas"] = -3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad), encoding="utf-8")
    proc = run_cli("dgd", "convert", "--to", "v1alpha1", str(path))
    assert proc.returncode == 1
    assert proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith("dynamo-snapshot dgd convert: DynamoGraphDeployment vllm-disagg: "), line
    assert "spec.components.1.replicas" in line, line
