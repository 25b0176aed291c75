"""`dynamo-snapshot identity`: the hash Dynamo's Go operator computes, for every kind of input, and
clear errors with trustworthy exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests" / "api" / "go_identity_vectors.json").read_text())["vectors"]
DGD = REPO / "tests" / "api" / "manifests" / "dgd-vllm-snapshot-auto.yaml"


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("identity", *args, input=stdin)


def _plain(identity: dict[str, object]) -> dict[str, object] | None:
    """The vector's identity as a file would hold it; None for raw-byte strings YAML cannot carry."""
    if "bytesBase64" in json.dumps(identity):
        return None
    out = dict(identity)
    if isinstance(out.get("extraParameters"), list):  # [key, value] pairs in the vectors file
        out["extraParameters"] = dict(out["extraParameters"])  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("vector", VECTORS[:6], ids=lambda v: str(v["name"]))
def test_identity_file_prints_the_go_operators_hash(vector: dict[str, Any], tmp_path: Path) -> None:
    identity = _plain(vector["identity"])
    if identity is None:
        pytest.skip("raw-byte identities cannot be written as YAML")
    path = tmp_path / "identity.json"
    path.write_text(json.dumps(identity))
    proc = _cli(str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == vector["hash"]


def test_a_dgd_prints_each_auto_service_and_one_service_alone() -> None:
    proc = _cli(str(DGD))
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()
    name, digest = line.split()
    assert name == "VllmDecodeWorker"
    assert len(digest) == 16
    alone = _cli(str(DGD), "--service", "VllmDecodeWorker")
    assert alone.stdout.strip() == digest


def test_a_service_with_a_checkpoint_ref_has_no_hash_even_with_an_identity(tmp_path: Path) -> None:
    """The controller restores such a service from the named checkpoint and ignores its identity."""
    dgd = yaml.safe_load(DGD.read_text())
    services = dgd["spec"]["services"]
    pinned = yaml.safe_load(yaml.safe_dump(services["VllmDecodeWorker"]))
    pinned["checkpoint"]["checkpointRef"] = "pinned-checkpoint"
    services["PinnedWorker"] = pinned
    path = tmp_path / "dgd.yaml"
    path.write_text(yaml.safe_dump(dgd))

    proc = _cli(str(path))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["VllmDecodeWorker"]
    alone = _cli(str(path), "--service", "PinnedWorker")
    assert alone.returncode == 1
    assert alone.stdout == ""
    assert "has no checkpoint identity" in alone.stderr


def test_a_checkpoint_from_stdin_matches_its_identity() -> None:
    identity = yaml.safe_load(DGD.read_text())["spec"]["services"]["VllmDecodeWorker"]["checkpoint"][
        "identity"
    ]
    ckpt = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "c"},
        "spec": {"identity": identity, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
    }
    proc = _cli("-", stdin=yaml.safe_dump(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == _cli(str(DGD), "--service", "VllmDecodeWorker").stdout.strip()


@pytest.mark.parametrize(
    ("content", "service", "words"),
    [
        ("model: x\nbackendFramework: pytorch\n", None, "backendFramework"),
        ("model: x\nbackendFramework: vllm\ntensorParallelSize: -1\n", None, "tensorParallelSize"),
        ("- a list\n", None, "expected a mapping"),
        ("kind: Pod\n", None, "kind Pod has no checkpoint identity"),
        ("{unclosed\n", None, "not YAML or JSON"),
        (None, "Nope", "no service 'Nope'"),
        (None, "Frontend", "has no checkpoint identity"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_1(
    content: str | None, service: str | None, words: str, tmp_path: Path
) -> None:
    path = DGD
    if content is not None:
        path = tmp_path / "in.yaml"
        path.write_text(content)
    proc = _cli(str(path), *(["--service", service] if service else []))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_usage_errors_exit_2_and_missing_files_exit_1(tmp_path: Path) -> None:
    assert _cli().returncode == 2
    missing = _cli(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr
