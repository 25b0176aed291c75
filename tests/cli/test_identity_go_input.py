"""`dynamo-snapshot identity FILE` reads a file as Dynamo gets it after `kubectl apply -f FILE`: read as
kubectl reads a file (bytes that are not UTF-8, byte-order marks), a JSON document decoded the way Go
decodes it (surrogate escapes), zero sizes hashed as Go hashes them, and what kubectl refuses refused in
one clear line."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot.cli.identity_cmd import IdentityInputError, hashes
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests" / "api" / "go_identity_vectors.json").read_text(encoding="utf-8"))[
    "vectors"
]
# JSON documents that are UTF-8, which kubectl passes on as they are; and files as kubectl reads them.
DECODED = [vector for vector in VECTORS if isinstance(vector.get("json"), str)]
FILES = [vector for vector in VECTORS if "kubectlFile" in vector]
LLAMA = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
LLAMA_HASH = "96429b2725761a09"  # Dynamo's own test value, for zero sizes too
ZEROS = {"tensorParallelSize": 0, "pipelineParallelSize": 0, "maxModelLen": 0}


def _source(vector: dict[str, Any]) -> bytes:
    source = vector["json"] if "json" in vector else vector["kubectlFile"]
    return base64.b64decode(source["bytesBase64"]) if isinstance(source, dict) else source.encode("utf-8")


def _cli_on(data: bytes, tmp_path: Path, name: str = "identity.json") -> subprocess.CompletedProcess[str]:
    path = tmp_path / name
    path.write_bytes(data)
    return run_cli("identity", str(path))


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr


def _negative(vector: dict[str, Any]) -> bool:
    return any(vector["identity"].get(key, 0) < 0 for key in ZEROS)


@pytest.mark.parametrize("vector", DECODED, ids=lambda v: str(v["name"]))
def test_a_json_document_hashes_as_go_hashes_it_after_decoding_it(vector: dict[str, Any]) -> None:
    if _negative(vector):
        # Go hashes negative sizes; Dynamo's CRD (and ours) refuses them.
        with pytest.raises(IdentityInputError, match="is negative, which Dynamo's CRD and this one refuse"):
            hashes(_source(vector))
    else:
        assert hashes(_source(vector)) == [vector["hash"]]


@pytest.mark.parametrize("vector", FILES, ids=lambda v: str(v["name"]))
def test_a_file_hashes_as_what_kubectl_apply_stores(vector: dict[str, Any]) -> None:
    assert hashes(_source(vector)) == [vector["hash"]]


def test_the_file_vectors_cover_kubectls_reading() -> None:
    names = {vector["name"] for vector in FILES}
    for kind in ("json", "yaml"):
        assert f"kubectl-{kind}-invalid-utf8-bytes" in names
        assert f"kubectl-{kind}-utf8-bom" in names
    assert {"kubectl-json-utf8-bom-then-invalid-bytes", "kubectl-json-utf16le-ill-formed"} <= names
    # The same document read by Go's JSON decoder alone (as the apiserver reads a request body) and by
    # kubectl from a file: the ill-formed bytes become U+FFFD per byte there, per maximal subpart here.
    by_name = {vector["name"]: vector for vector in VECTORS}
    assert by_name["json-invalid-utf8-bytes"]["hash"] != by_name["kubectl-json-invalid-utf8-bytes"]["hash"]


@pytest.mark.parametrize(
    "name",
    [
        "zero-sizes-and-max-model-len",
        "json-surrogate-escapes-in-extra-parameters",
        "kubectl-yaml-invalid-utf8-bytes",
    ],
)
def test_a_file_prints_the_hash_go_computes(name: str, tmp_path: Path) -> None:
    [vector] = [v for v in VECTORS if v["name"] == name]
    proc = _cli_on(_source(vector), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == vector["hash"]


def test_a_negative_size_is_one_clear_line(tmp_path: Path) -> None:
    [vector] = [v for v in DECODED if _negative(v)]
    _one_line_error(_cli_on(_source(vector), tmp_path), "tensorParallelSize: -1 is negative", "no hash")


def test_zero_sizes_in_yaml_hash_to_dynamos_known_value(tmp_path: Path) -> None:
    proc = _cli_on(yaml.safe_dump({**LLAMA, **ZEROS}).encode(), tmp_path, "identity.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == LLAMA_HASH


def test_zero_sizes_in_a_dgd_and_a_checkpoint_from_stdin(tmp_path: Path) -> None:
    dgd = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g"},
        "spec": {
            "services": {
                "Worker": {
                    "componentType": "worker",
                    "checkpoint": {"enabled": True, "identity": LLAMA | ZEROS},
                }
            }
        },
    }
    proc = _cli_on(yaml.safe_dump(dgd).encode(), tmp_path, "dgd.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"Worker {LLAMA_HASH}"

    checkpoint = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "c"},
        "spec": {"identity": LLAMA | ZEROS, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
    }
    piped = run_cli("identity", "-", input=json.dumps(checkpoint))
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() == LLAMA_HASH


def test_a_surrogate_pair_escape_in_json_is_its_character(tmp_path: Path) -> None:
    escaped = _cli_on(b'{"model":"x\\ud83d\\ude00","backendFramework":"vllm"}', tmp_path)
    literal = _cli_on('{"model":"x😀","backendFramework":"vllm"}'.encode(), tmp_path, "literal.json")
    assert escaped.returncode == literal.returncode == 0, escaped.stderr + literal.stderr
    assert escaped.stdout == literal.stdout


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('model: "x\\ud83d\\ude00"\nbackendFramework: vllm\n', ["model:", "\\ud83d", "surrogate"]),
        ('model: m\nbackendFramework: vllm\nextraParameters:\n  k: "\\udcff"\n', ["extraParameters.k:"]),
    ],
)
def test_surrogate_escapes_in_yaml_are_refused_as_kubectl_refuses_them(
    content: str, words: list[str], tmp_path: Path
) -> None:
    _one_line_error(_cli_on(content.encode(), tmp_path, "identity.yaml"), *words)


def test_yaml_not_utf8_after_a_utf8_byte_order_mark_is_refused_with_the_byte(tmp_path: Path) -> None:
    # kubectl passes the bytes after the mark on unchecked, and its YAML reader refuses them.
    proc = _cli_on(b"\xef\xbb\xbfmodel: bad\xffbyte\nbackendFramework: vllm\n", tmp_path, "identity.yaml")
    _one_line_error(proc, "not UTF-8", "0xff", "offset 10")


def test_a_yaml_escape_of_the_whole_code_point_is_its_character(tmp_path: Path) -> None:
    proc = _cli_on(b'model: "x\\U0001F600"\nbackendFramework: vllm\n', tmp_path, "identity.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == next(
        v["hash"] for v in VECTORS if v["name"] == "json-surrogate-pair-escape"
    )
