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

from dynamo_snapshot.api.gojson import go_quote, go_string_map
from dynamo_snapshot.api.identity import (
    BackendFramework,
    CheckpointIdentity,
    compute_identity_hash,
    identity_hash_payload,
)

VECTORS_FILE = Path(__file__).resolve().parent / "go_identity_vectors.json"
VECTORS: list[dict[str, Any]] = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vectors"]


def _go_string(value: str | dict[str, str]) -> str:
    """A fixture string; raw bytes that are not UTF-8 arrive the way Python carries them."""
    if isinstance(value, dict):
        return base64.b64decode(value["bytesBase64"]).decode("utf-8", "surrogateescape")
    return value


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
    ):
        assert expected in names


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
