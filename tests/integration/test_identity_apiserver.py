"""Identities as the real apiserver (Go) takes them: zero sizes admitted and hashed as Dynamo hashes them;
a request body's escapes and ill-formed bytes decoded as go_unmarshal decodes them; and a manifest file
hashed by the identity command as `kubectl apply -f` stores it."""

from __future__ import annotations

import base64
import codecs
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.gojson import go_unmarshal
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION
from dynamo_snapshot.cli.identity_cmd import hashes
from dynamo_snapshot_dev.localcluster import LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def crds(crds: list[str], v1alpha1_served: None) -> list[str]:
    """The CRDs with v1alpha1 DGDs served too (the chart's arrangement): this module applies v1alpha1
    manifests. crds/ alone serves v1beta1 only (test_crds_as_shipped.py)."""
    return crds


VECTORS = json.loads((Path(__file__).parents[1] / "api" / "go_identity_vectors.json").read_text("utf-8"))[
    "vectors"
]
LLAMA = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
ZEROS = {"tensorParallelSize": 0, "pipelineParallelSize": 0, "maxModelLen": 0}


def _checkpoint(name: str, identity: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": name},
        "spec": {
            "identity": identity,
            "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "worker:1"}]}}},
        },
    }


async def _get(api: client.ApiClient, namespace: str, plural: str, name: str) -> dict[str, Any]:
    stored: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        API_GROUP, API_VERSION, namespace, plural, name
    )
    return stored


async def test_zero_sizes_are_admitted_kept_and_hashed_as_dynamo_does(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str
) -> None:
    cluster.apply(_checkpoint("zeros", LLAMA | ZEROS), namespace)
    stored = await _get(api, namespace, "dynamocheckpoints", "zeros")
    identity = stored["spec"]["identity"]
    # An explicit 0 is not defaulted: it is kept, and only the hash reads it as Go does.
    assert {key: identity[key] for key in ZEROS} == ZEROS
    assert compute_identity_hash(identity) == "96429b2725761a09"
    assert DynamoCheckpoint.model_validate(stored).spec.identity.compute_hash() == "96429b2725761a09"

    dgd = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "zeros"},
        "spec": {
            "services": {
                "worker": {
                    "componentType": "worker",
                    "replicas": 1,
                    "checkpoint": {"enabled": True, "identity": LLAMA | ZEROS},
                }
            }
        },
    }
    cluster.apply(dgd, namespace)
    stored_dgd = DynamoGraphDeployment.model_validate(
        await _get(api, namespace, "dynamographdeployments", "zeros")
    )
    service = (stored_dgd.spec.services or {})["worker"]
    assert service.checkpoint is not None
    assert service.checkpoint.identity is not None
    assert service.checkpoint.identity.compute_hash() == "96429b2725761a09"


def _manifest_around(name: str, identity_json: bytes) -> bytes:
    """A DynamoCheckpoint manifest as JSON with ``identity_json`` spliced in byte for byte."""
    placeholder = {"model": "placeholder", "backendFramework": "vllm"}
    manifest = json.dumps(_checkpoint(name, placeholder)).encode()
    return manifest.replace(json.dumps(placeholder).encode(), identity_json)


@pytest.mark.parametrize(
    "name",
    [
        "json-surrogate-pair-escape",
        "json-lone-high-surrogate-escape",
        "json-surrogate-escapes-in-extra-parameters",
        "json-invalid-utf8-bytes",
        "json-high-surrogate-escape-then-raw-byte",
    ],
)
async def test_the_apiserver_decodes_a_request_body_as_go_unmarshal_does(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str, name: str, tmp_path: Path
) -> None:
    [vector] = [v for v in VECTORS if v["name"] == name]
    source = vector["json"]
    body = _manifest_around(
        name, base64.b64decode(source["bytesBase64"]) if isinstance(source, dict) else source.encode()
    )
    path = tmp_path / "body.json"
    path.write_bytes(body)
    # --raw sends the file as the request body, untouched by kubectl's own reading of files.
    uri = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/dynamocheckpoints"
    cluster.kubectl("create", "--raw", uri, "-f", str(path))

    stored = await _get(api, namespace, "dynamocheckpoints", name)
    assert compute_identity_hash(stored["spec"]["identity"]) == vector["hash"]
    assert compute_identity_hash(go_unmarshal(body)["spec"]["identity"]) == vector["hash"]


# Bytes kubectl has to repair when it reads a file: a lone byte, a truncated sequence, an encoded
# surrogate, an overlong, one past U+10FFFF, stray continuation bytes, then valid text.
ILL_FORMED = (
    b"bad\xffbyte \xe2\x82 \xed\xa0\x80 \xf0\x9f\x98 \xc0\xaf \xf4\x90\x80\x80 \x80\xbf \xf0\x9f\x98\x80"
)


def _yaml_manifest(name: str, model: bytes) -> bytes:
    return (
        b"apiVersion: nvidia.com/v1alpha1\nkind: DynamoCheckpoint\nmetadata:\n  name: "
        + name.encode()
        + b'\nspec:\n  identity:\n    model: "'
        + model
        + b'"\n    backendFramework: vllm\n'
        + b"    tensorParallelSize: 0\n  job:\n    podTemplateSpec:\n      spec:\n"
        + b"        containers: [{name: main, image: 'worker:1'}]\n"
    )


MANIFESTS = {
    "json-ill-formed": lambda name: _manifest_around(
        name, b'{"model":"' + ILL_FORMED + b'","backendFramework":"vllm"}'
    ),
    "yaml-ill-formed": lambda name: _yaml_manifest(name, ILL_FORMED),
    "json-escapes": lambda name: _manifest_around(
        name, b'{"model":"x\\ud83d\\ude00 \\ud83d \\udcff","backendFramework":"vllm","maxModelLen":0}'
    ),
    "utf8-bom-json-ill-formed": lambda name: (
        b"\xef\xbb\xbf" + _manifest_around(name, b'{"model":"' + ILL_FORMED + b'","backendFramework":"vllm"}')
    ),
    "utf16le-yaml": lambda name: (
        codecs.BOM_UTF16_LE + _yaml_manifest(name, "x\U0001f600 \u00e9".encode()).decode().encode("utf-16-le")
    ),
    "utf16be-yaml-lone-surrogate": lambda name: (
        codecs.BOM_UTF16_BE
        + _yaml_manifest(name, b"x@@")
        .decode()
        .encode("utf-16-be")
        .replace("@@".encode("utf-16-be"), b"\xd8\x3d")
    ),
}


@pytest.mark.parametrize("kind", MANIFESTS)
async def test_the_identity_command_hashes_a_file_as_kubectl_apply_stores_it(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str, kind: str, tmp_path: Path
) -> None:
    manifest = MANIFESTS[kind](kind)
    path = tmp_path / "checkpoint"
    path.write_bytes(manifest)
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))

    stored = await _get(api, namespace, "dynamocheckpoints", kind)
    assert hashes(manifest) == [compute_identity_hash(stored["spec"]["identity"])]
