"""The DGD conversion webhook as the apiserver calls it: HTTPS POST of a ConversionReview to
CONVERSION_PATH on the controller's WebhookServer. Every answer is a ConversionReview with status 200, a
bad request's a Failure with a message saying what is wrong, each counted by outcome."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client
from prometheus_client import REGISTRY

from dynamo_snapshot.api.dgd_conversion import V1ALPHA1, V1BETA1, to_v1alpha1
from dynamo_snapshot.controller.webhook_server import CONVERSION_PATH
from dynamo_snapshot.kube import Kube
from tests.helpers.webhook import make_certs, serving, until

FIXTURE = Path(__file__).resolve().parents[1] / "api" / "fixtures" / "dgd_v1beta1" / "vllm-agg.yaml"
Obj = dict[str, Any]


def _beta() -> Obj:
    beta = yaml.safe_load(FIXTURE.read_text(encoding="utf-8"))
    beta["metadata"].update(namespace="ns", uid="0b1c", resourceVersion="7")
    return beta


def _review(desired: str, *objects: Obj, uid: str = "r-1") -> Obj:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {"uid": uid, "desiredAPIVersion": desired, "objects": list(objects)},
    }


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("dynsnap_dgd_conversions_total", {"outcome": outcome}) or 0.0


Post = Any


@pytest.fixture
async def post(tmp_path: Path) -> AsyncIterator[Post]:
    certs = make_certs(tmp_path)
    async with (
        client.ApiClient(client.Configuration()) as unused,  # conversion looks nothing up
        serving(Kube(unused), certs.directory) as (server, _),
        aiohttp.ClientSession() as session,
    ):
        await until(lambda: server.readiness() is None, "the webhook to listen")
        context = ssl.create_default_context(cadata=certs.ca.decode())
        url = f"https://127.0.0.1:{server.port}{CONVERSION_PATH}"

        async def send(body: Obj | bytes) -> Obj:
            data = body if isinstance(body, bytes) else None
            as_json = None if isinstance(body, bytes) else body
            async with session.post(url, json=as_json, data=data, ssl=context) as resp:
                assert resp.status == 200, await resp.text()
                answer: Obj = await resp.json()
            assert answer["apiVersion"] == "apiextensions.k8s.io/v1"
            assert answer["kind"] == "ConversionReview"
            return answer

        yield send


async def test_a_good_review_is_converted_both_ways(post: Post) -> None:
    beta = _beta()
    before = _count("Success")
    answer = (await post(_review(V1ALPHA1, beta)))["response"]
    assert answer["uid"] == "r-1"
    assert answer["result"] == {"status": "Success"}
    [alpha] = answer["convertedObjects"]
    assert alpha == to_v1alpha1(beta)
    assert alpha["apiVersion"] == V1ALPHA1
    assert set(alpha["spec"]["services"]) == {"Frontend", "VllmDecodeWorker"}
    assert alpha["metadata"]["uid"] == "0b1c"

    back = (await post(_review(V1BETA1, alpha, uid="r-2")))["response"]
    assert back["uid"] == "r-2"
    assert back["convertedObjects"] == [beta]
    assert _count("Success") == before + 2


async def test_garbage_is_a_failure_that_says_so(post: Post) -> None:
    before = _count("Failure")
    not_json = (await post(b"{not json"))["response"]
    assert not_json["result"]["status"] == "Failure"
    assert not_json["result"]["message"].startswith("the request body is not JSON: ")
    assert "convertedObjects" not in not_json

    bare = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"}
    no_request = (await post(bare))["response"]
    assert no_request["result"] == {"status": "Failure", "message": "the ConversionReview has no request"}

    wrong_shape = (await post({"request": {"uid": "r-3", "objects": "x"}}))["response"]
    assert wrong_shape["uid"] == "r-3"
    assert wrong_shape["result"]["status"] == "Failure"
    message = wrong_shape["result"]["message"]
    assert message.startswith("not an apiextensions.k8s.io/v1 ConversionReview request")
    assert "desiredAPIVersion" in message
    assert _count("Failure") == before + 3


async def test_an_unknown_desired_version_is_a_failure_naming_the_served_ones(post: Post) -> None:
    answer = (await post(_review("nvidia.com/v2", _beta(), uid="r-4")))["response"]
    assert answer["uid"] == "r-4"
    assert answer["result"] == {
        "status": "Failure",
        "message": "desiredAPIVersion 'nvidia.com/v2' is not served for "
        "DynamoGraphDeployment: use nvidia.com/v1alpha1 or nvidia.com/v1beta1",
    }
    # Even with no object to convert.
    empty = (await post(_review("nvidia.com/v2", uid="r-5")))["response"]
    assert empty["result"]["status"] == "Failure"


async def test_an_invalid_object_is_a_failure_with_the_models_message(post: Post) -> None:
    beta = _beta()
    beta["spec"]["components"][1]["replicas"] = -1
    answer = (await post(_review(V1ALPHA1, beta)))["response"]
    assert answer["result"]["status"] == "Failure"
    assert answer["result"]["message"].startswith("objects[0] (ns/vllm-agg): spec.components.1.replicas")
