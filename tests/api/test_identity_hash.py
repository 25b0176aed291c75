"""The identity hash must be byte-for-byte the one Dynamo's Go operator computes."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.crdgen import build_crd
from dynamo_snapshot.api.gojson import go_quote, go_string_map, go_unmarshal
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.identity import (
    BackendFramework,
    CheckpointIdentity,
    compute_identity_hash,
    identity_hash_payload,
)

VECTORS_FILE = Path(__file__).resolve().parent / "go_identity_vectors.json"
VECTORS: list[dict[str, Any]] = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vectors"]
# Vectors Go decoded from a JSON document: what a file holds, before any decoding.
DECODED = [vector for vector in VECTORS if "json" in vector]
SIZES = ("tensorParallelSize", "pipelineParallelSize", "maxModelLen")


def _go_string(value: str | dict[str, str]) -> str:
    """A fixture string; raw bytes that are not UTF-8 arrive the way Python carries them."""
    if isinstance(value, dict):
        return base64.b64decode(value["bytesBase64"]).decode("utf-8", "surrogateescape")
    return value


def _json_bytes(vector: dict[str, Any]) -> bytes:
    """The document a decoded vector was read from, byte for byte."""
    source = vector["json"]
    return base64.b64decode(source["bytesBase64"]) if isinstance(source, dict) else source.encode("utf-8")


def _identity_from_vector(vector: dict[str, Any]) -> dict[str, Any]:
    identity: dict[str, Any] = {}
    for key, value in vector["identity"].items():
        if key == "extraParameters":
            identity[key] = {_go_string(k): _go_string(v) for k, v in value}
        elif isinstance(value, int):
            identity[key] = value
        else:
            identity[key] = _go_string(value)
    return identity


def test_known_value_from_dynamo() -> None:
    identity = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
    assert compute_identity_hash(identity) == "96429b2725761a09"
    model = CheckpointIdentity(model="meta-llama/Llama-2-7b-hf", backend_framework=BackendFramework.VLLM)
    assert model.compute_hash() == "96429b2725761a09"


@pytest.mark.parametrize("vector", VECTORS, ids=[vector["name"] for vector in VECTORS])
def test_matches_go_reference_vector(vector: dict[str, Any]) -> None:
    identity = _identity_from_vector(vector)
    assert identity_hash_payload(identity) == vector["payload"].encode("utf-8")
    assert compute_identity_hash(identity) == vector["hash"]


def test_reference_vectors_cover_the_tricky_cases() -> None:
    names = {vector["name"] for vector in VECTORS}
    for expected in (
        "known-llama2-7b",
        "html-characters",
        "control-characters",
        "line-and-paragraph-separators",
        "invalid-utf8-lone-byte",
        "extra-parameters-sorted-bytewise",
        "zero-sizes-and-max-model-len",
        "negative-and-zero-sizes",
        "json-surrogate-pair-escape",
        "json-lone-high-surrogate-escape",
        "json-lone-low-surrogate-escape",
        "json-surrogate-escapes-in-extra-parameters",
        "json-invalid-utf8-bytes",
    ):
        assert expected in names


# --- zero sizes: Go's omitempty int32, where 0 is unset -------------------------------------------


def test_zero_sizes_hash_to_dynamos_known_value() -> None:
    identity = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
    zeros = {**identity, "tensorParallelSize": 0, "pipelineParallelSize": 0, "maxModelLen": 0}
    assert compute_identity_hash(zeros) == "96429b2725761a09"
    model = CheckpointIdentity.model_validate(zeros)
    assert (model.tensor_parallel_size, model.pipeline_parallel_size, model.max_model_len) == (0, 0, 0)
    assert model.compute_hash() == "96429b2725761a09"
    # Kept as given, so the stored object reads back unchanged; only the hash normalises.
    assert model.to_dict() == zeros


# Decoded vectors with a size of 0 and none below.
ZERO_SIZES = [vector for vector in DECODED if min(vector["identity"].get(key, 1) for key in SIZES) == 0]


@pytest.mark.parametrize("vector", ZERO_SIZES, ids=lambda v: v["name"])
def test_the_model_hashes_zero_sizes_like_go(vector: dict[str, Any]) -> None:
    identity = _identity_from_vector(vector)
    assert CheckpointIdentity.model_validate(identity).compute_hash() == vector["hash"]


def test_zero_size_vectors_exist() -> None:
    assert len(ZERO_SIZES) >= 3


@pytest.mark.parametrize("key", SIZES)
def test_zero_is_admitted_inside_a_checkpoint_and_a_dgd(key: str) -> None:
    identity = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm", key: 0}
    checkpoint = DynamoCheckpoint.model_validate(
        {"spec": {"identity": identity, "job": {"podTemplateSpec": {}}}}
    )
    assert checkpoint.spec.identity.compute_hash() == "96429b2725761a09"
    dgd = DynamoGraphDeployment.model_validate(
        {"spec": {"services": {"w": {"checkpoint": {"enabled": True, "identity": identity}}}}}
    )
    auto = (dgd.spec.services or {})["w"].checkpoint
    assert auto is not None
    assert auto.identity is not None
    assert auto.identity.compute_hash() == "96429b2725761a09"


@pytest.mark.parametrize("key", SIZES)
def test_negative_sizes_hash_like_go_but_the_model_refuses_them(key: str) -> None:
    identity = {"model": "m", "backendFramework": "vllm", key: -1}
    payload = identity_hash_payload(identity)
    # Go keeps a negative value as it is (only 0 is normalised).
    assert f'"{key}":-1'.encode() in payload
    with pytest.raises(ValidationError) as exc:
        CheckpointIdentity.model_validate(identity)
    [error] = exc.value.errors()
    assert error["loc"] == (key,)
    assert "greater than or equal to 0" in error["msg"]


@pytest.mark.parametrize("resource", [DynamoCheckpoint, DynamoGraphDeployment])
def test_the_crd_schema_admits_zero_sizes_and_refuses_negative(resource: Any) -> None:
    schema = build_crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    if resource is DynamoCheckpoint:
        identity = schema["properties"]["spec"]["properties"]["identity"]
    else:
        service = schema["properties"]["spec"]["properties"]["services"]["additionalProperties"]
        identity = service["properties"]["checkpoint"]["properties"]["identity"]
    for key in SIZES:
        assert identity["properties"][key]["minimum"] == 0, key
    assert [identity["properties"][key].get("default") for key in SIZES] == [1, 1, None]


# --- reading JSON as Go does ----------------------------------------------------------------------


@pytest.mark.parametrize("vector", DECODED, ids=lambda v: v["name"])
def test_json_documents_decode_and_hash_as_in_go(vector: dict[str, Any]) -> None:
    decoded = go_unmarshal(_json_bytes(vector))
    assert decoded == _identity_from_vector(vector)
    assert compute_identity_hash(decoded) == vector["hash"]
    if all(decoded.get(key, 0) >= 0 for key in SIZES):
        assert CheckpointIdentity.model_validate(decoded).compute_hash() == vector["hash"]


def test_pydantics_own_json_parser_refuses_what_go_reads() -> None:
    """Why go_unmarshal exists: pydantic's parser refuses a lone surrogate escape Go reads as U+FFFD."""
    document = '{"model":"x\\ud83dy","backendFramework":"vllm"}'
    with pytest.raises(ValidationError, match=r"hex escape"):
        CheckpointIdentity.model_validate_json(document)
    identity = CheckpointIdentity.model_validate(go_unmarshal(document))
    assert identity.model == "x\ufffdy"


@given(
    st.text(
        alphabet=st.characters(codec=None, categories=["L", "N", "P", "Cs", "So"]),
        max_size=12,
    )
)
def test_go_unmarshal_reads_escaped_surrogates_like_a_utf16_decoder(value: str) -> None:
    # json.dumps escapes every surrogate, so the document holds \uXXXX for each; Go joins a high and a
    # low one into their character and reads every other one as U+FFFD, as a UTF-16 decoder does.
    oracle = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    assert go_unmarshal(json.dumps({"k": value})) == {"k": oracle}


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ('{"\\ud800":1,"\\udfff":2}', {"\ufffd": 2}),
        (b'{"a":["\\ude00",{"\\ud83d\\ude00":"\xff"}]}', {"a": ["\ufffd", {"\U0001f600": "\ufffd"}]}),
        (b'"\xe2\x82"', "\ufffd\ufffd"),
        ("[1, 2.5, true, null]", [1, 2.5, True, None]),
    ],
)
def test_go_unmarshal_shapes(document: str | bytes, expected: Any) -> None:
    assert go_unmarshal(document) == expected


@pytest.mark.parametrize("document", ['{"a": NaN}', "[Infinity]", "-Infinity"])
def test_go_unmarshal_refuses_non_finite_numbers(document: str) -> None:
    with pytest.raises(ValueError, match="is not a JSON value"):
        go_unmarshal(document)


@pytest.mark.parametrize("document", ['{"a": 1,}', "{'a': 1}", '"tab\there"', b'{"a":"b"}\xff'])
def test_go_unmarshal_refuses_malformed_documents(document: str | bytes) -> None:
    with pytest.raises(json.JSONDecodeError):
        go_unmarshal(document)


# --- hand-computed Go encoding/json outputs ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", b'"plain"'),
        ("<b>&amp;", b'"\\u003cb\\u003e\\u0026amp;"'),
        ('quote " backslash \\', b'"quote \\" backslash \\\\"'),
        ("\b\f\n\r\t", b'"\\b\\f\\n\\r\\t"'),
        ("\x00\x01\x0b\x1b\x1f", b'"\\u0000\\u0001\\u000b\\u001b\\u001f"'),
        ("\x7f", b'"\x7f"'),
        ("a\u2028b\u2029c", b'"a\\u2028b\\u2029c"'),
        ("\u2027\u202a", '"\u2027\u202a"'.encode()),
        ("é日🚀", '"é日🚀"'.encode()),
        ("\ufffd", '"\ufffd"'.encode()),
        ("/slash", b'"/slash"'),
        (b"bad\xffbyte", b'"bad\\ufffdbyte"'),
        (b"\xe2\x82", b'"\\ufffd\\ufffd"'),
        (b"\xed\xa0\x80", b'"\\ufffd\\ufffd\\ufffd"'),
        (b"\xc0\xaf", b'"\\ufffd\\ufffd"'),
        ("bad\udcffbyte", b'"bad\\ufffdbyte"'),
        ("lone \ud800 surrogate", b'"lone \\ufffd\\ufffd\\ufffd surrogate"'),
    ],
)
def test_go_string_escaping(value: str | bytes, expected: bytes) -> None:
    assert go_quote(value) == expected


def test_go_map_keys_sorted_by_bytes() -> None:
    encoded = go_string_map({"b": "2", "é": "3", "B": "1", "a<": "&", "": "0"})
    assert encoded == '{"":"0","B":"1","a\\u003c":"\\u0026","b":"2","é":"3"}'.encode()


@given(st.text())
def test_go_quote_agrees_with_an_independent_oracle(value: str) -> None:
    # Python's json with ensure_ascii=False escapes exactly like Go except for Go's HTML and JS
    # line-terminator escapes, which are added on top.
    oracle = json.dumps(value, ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        oracle = oracle.replace(char, escape)
    oracle = oracle.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    assert go_quote(value) == oracle.encode("utf-8")


# --- normalisation properties ---------------------------------------------------------------------

backends = st.sampled_from([framework.value for framework in BackendFramework])
texts = st.text(max_size=24)
extra_parameters = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=6)


@st.composite
def identities(draw: st.DrawFn) -> dict[str, Any]:
    identity: dict[str, Any] = {
        "model": draw(st.text(min_size=1, max_size=24)),
        "backendFramework": draw(backends),
    }
    optional = {
        "dynamoVersion": st.text(min_size=1, max_size=8),
        "tensorParallelSize": st.integers(min_value=2, max_value=64),
        "pipelineParallelSize": st.integers(min_value=2, max_value=8),
        "dtype": st.text(min_size=1, max_size=8),
        "maxModelLen": st.integers(min_value=1, max_value=2**31 - 1),
        "extraParameters": extra_parameters.filter(bool),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            identity[key] = draw(strategy)
    return identity


@given(identities(), st.randoms(use_true_random=False))
def test_extra_parameter_order_never_changes_the_hash(identity: dict[str, Any], rng: Any) -> None:
    items = list(identity.get("extraParameters", {}).items())
    rng.shuffle(items)
    reordered = {**identity, "extraParameters": dict(items)} if items else identity
    assert compute_identity_hash(reordered) == compute_identity_hash(identity)


@given(identities(), st.sampled_from(["tensorParallelSize", "pipelineParallelSize"]), st.data())
def test_parallel_size_zero_one_and_unset_hash_the_same(
    identity: dict[str, Any], key: str, data: st.DataObject
) -> None:
    unset = {k: v for k, v in identity.items() if k != key}
    variant = data.draw(st.sampled_from([{**unset, key: 0}, {**unset, key: 1}, {**unset, key: None}, unset]))
    assert compute_identity_hash(variant) == compute_identity_hash({**unset, key: 1})


@given(identities(), st.sampled_from(["dtype", "dynamoVersion", "maxModelLen", "extraParameters"]), st.data())
def test_zero_values_hash_like_unset_fields(identity: dict[str, Any], key: str, data: st.DataObject) -> None:
    zero: Any = {"dtype": "", "dynamoVersion": "", "maxModelLen": 0, "extraParameters": {}}[key]
    unset = {k: v for k, v in identity.items() if k != key}
    variant = data.draw(st.sampled_from([{**unset, key: zero}, {**unset, key: None}]))
    assert compute_identity_hash(variant) == compute_identity_hash(unset)


@given(identities())
def test_model_and_mapping_hash_alike(identity: dict[str, Any]) -> None:
    model = CheckpointIdentity.model_validate(identity)
    assert model.compute_hash() == compute_identity_hash(identity)
    assert compute_identity_hash(model.to_dict()) == compute_identity_hash(identity)


@given(identities())
def test_hash_is_sixteen_lowercase_hex_digits(identity: dict[str, Any]) -> None:
    assert re.fullmatch(r"[0-9a-f]{16}", compute_identity_hash(identity))


@given(identities())
def test_payload_is_the_normalised_identity_as_json(identity: dict[str, Any]) -> None:
    expected: dict[str, Any] = {
        "model": identity["model"],
        "backendFramework": identity["backendFramework"],
        "tensorParallelSize": identity.get("tensorParallelSize", 1),
        "pipelineParallelSize": identity.get("pipelineParallelSize", 1),
    }
    for key in ("dynamoVersion", "dtype", "maxModelLen", "extraParameters"):
        if identity.get(key):
            expected[key] = identity[key]
    payload = identity_hash_payload(identity)
    assert json.loads(payload) == expected
    # Go writes the struct's fields in declaration order, never sorted.
    assert list(json.loads(payload)) == [
        key
        for key in (
            "model",
            "backendFramework",
            "dynamoVersion",
            "tensorParallelSize",
            "pipelineParallelSize",
            "dtype",
            "maxModelLen",
            "extraParameters",
        )
        if key in expected
    ]


def test_different_identities_hash_differently() -> None:
    base: dict[str, Any] = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
    variants: list[dict[str, Any]] = [
        {**base, "model": "meta-llama/Llama-2-13b-hf"},
        {**base, "backendFramework": "sglang"},
        {**base, "tensorParallelSize": 2},
        {**base, "dtype": "bfloat16"},
        {**base, "extraParameters": {"gpu_memory_utilization": "0.8"}},
    ]
    hashes = {compute_identity_hash(identity) for identity in [base, *variants]}
    assert len(hashes) == len(variants) + 1


@pytest.mark.parametrize(
    ("identity", "error", "match"),
    [
        ({"model": "m", "backendFramework": "vllm", "framework": "vllm"}, ValueError, "framework"),
        (
            {"model": "m", "backendFramework": "vllm", "tensorParallelSize": "2"},
            TypeError,
            "tensorParallelSize",
        ),
        (
            {"model": "m", "backendFramework": "vllm", "tensorParallelSize": True},
            TypeError,
            "tensorParallelSize",
        ),
        ({"model": "m", "backendFramework": "vllm", "maxModelLen": 2**31}, ValueError, "int32"),
        ({"model": 7, "backendFramework": "vllm"}, TypeError, "model"),
        (
            {"model": "m", "backendFramework": "vllm", "extraParameters": {"a": 1}},
            TypeError,
            "extraParameters",
        ),
    ],
)
def test_mapping_input_is_type_checked(identity: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        compute_identity_hash(identity)
