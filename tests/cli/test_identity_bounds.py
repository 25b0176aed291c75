"""`dynamo-snapshot identity` reads files someone else wrote: aliases and nesting are bounded before
anything is expanded, and a negative size is refused with the reason, in one line and exit 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.cli.bounded_yaml import MAX_ALIAS_NODES, MAX_DEPTH, YAMLTooLarge, safe_load_bounded
from dynamo_snapshot.cli.identity_cmd import IdentityInputError, hashes, load_document
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests" / "api" / "go_identity_vectors.json").read_text(encoding="utf-8"))[
    "vectors"
]
DGD = REPO / "tests" / "api" / "manifests" / "dgd-vllm-snapshot-auto.yaml"

# Nine levels of nine aliases: 9**9 (387 million) strings once expanded, from 500 bytes.
BILLION_LAUGHS = "\n".join(
    [
        'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(f"l{n}: &l{n} [{','.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 9)),
        "model: m",
        "backendFramework: vllm",
    ]
)


def _one_line_refusal(path: Path, *words: str) -> None:
    proc = run_cli("identity", str(path))
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr


def test_the_billion_laughs_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(IdentityInputError, match=rf"aliases expand to more than {MAX_ALIAS_NODES} nodes"):
        load_document(BILLION_LAUGHS)
    # Expanding it takes minutes and gigabytes; refusing it only composes the 500-byte file.
    assert time.perf_counter() - started < 1.0
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    _one_line_refusal(path, "aliases expand to more than", "line ")


def test_the_alias_bound_counts_expanded_nodes_not_aliases() -> None:
    # An anchored list of 99 scalars is 100 nodes, so this many aliases to it add exactly the bound.
    uses = MAX_ALIAS_NODES // 100
    items = ",".join(["x"] * 99)
    head = f"a: &a [{items}]\n"
    at_bound = head + "".join(f"b{n}: *a\n" for n in range(uses))
    doc = safe_load_bounded(at_bound)
    assert len(doc) == uses + 1
    assert doc["b0"] == ["x"] * 99
    with pytest.raises(YAMLTooLarge, match="aliases expand"):
        safe_load_bounded(at_bound + "over: *a\n")


def test_an_alias_to_a_node_that_contains_it_is_refused() -> None:
    for text in ("a: &a [*a]\n", "a: &a {b: [1, {c: *a}]}\n"):
        with pytest.raises(IdentityInputError, match=r"alias \*a \(line 1, column \d+\) refers to a node"):
            load_document(text)


def test_a_dgd_that_shares_an_identity_through_an_anchor_hashes_as_written_out(tmp_path: Path) -> None:
    """kubectl reads aliases, so a manifest that uses one within the bound gets its hash."""
    dgd = yaml.safe_load(DGD.read_text())
    services = dgd["spec"]["services"]
    # The same checkpoint object twice: the dumper writes it once with an anchor, then as an alias.
    services["SecondWorker"] = {**services["VllmDecodeWorker"]}
    anchored = yaml.safe_dump(dgd)
    written_out = yaml.dump(dgd, Dumper=_WritingOutDumper)
    assert "&id" in anchored
    assert "*id" in anchored
    assert "&id" not in written_out
    assert hashes(anchored) == hashes(written_out)
    path = tmp_path / "dgd.yaml"
    path.write_text(anchored)
    proc = run_cli("identity", str(path))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["SecondWorker", "VllmDecodeWorker"]


class _WritingOutDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def test_nesting_is_bounded_in_yaml_and_json(tmp_path: Path) -> None:
    # The root mapping is level 1, so MAX_DEPTH - 1 nested lists reach the bound and one more passes it.
    for depth, ok in ((MAX_DEPTH - 1, True), (MAX_DEPTH, False)):
        yaml_text = "a: " + "[" * depth + "]" * depth
        json_text = '{"a": ' + "[" * depth + "]" * depth + "}"
        for text in (yaml_text, json_text):
            if ok:
                assert load_document(text)["a"] is not None
            else:
                with pytest.raises(IdentityInputError, match=f"nested deeper than {MAX_DEPTH} levels"):
                    load_document(text)
    # Far past Python's recursion limit: still the same one line, not a traceback.
    for name, text in (("deep.yaml", "a: " + "[" * 100_000), ("deep.json", '{"a":' + "[" * 100_000)):
        path = tmp_path / name
        path.write_text(text)
        _one_line_refusal(path, f"nested deeper than {MAX_DEPTH} levels")


NEGATIVE = next(vector for vector in VECTORS if vector["name"] == "negative-values-kept")


def test_negative_sizes_hash_in_go_but_the_command_refuses_them_and_says_why(tmp_path: Path) -> None:
    identity = NEGATIVE["identity"]
    # The library reproduces Go's function, which hashes any int32 ...
    assert compute_identity_hash(identity) == NEGATIVE["hash"]
    # ... but no cluster can hold such an identity, so the command prints no hash for it.
    path = tmp_path / "identity.json"
    path.write_text(json.dumps(identity))
    _one_line_refusal(path, "tensorParallelSize: -3 is negative", "CRD", "no hash")


@pytest.mark.parametrize("key", ["tensorParallelSize", "pipelineParallelSize", "maxModelLen"])
def test_a_negative_size_inside_a_dgd_names_its_field_and_the_reason(key: str, tmp_path: Path) -> None:
    dgd = yaml.safe_load(DGD.read_text())
    dgd["spec"]["services"]["VllmDecodeWorker"]["checkpoint"]["identity"][key] = -1
    path = tmp_path / "dgd.yaml"
    path.write_text(yaml.safe_dump(dgd))
    _one_line_refusal(
        path, f"spec.services.VllmDecodeWorker.checkpoint.identity.{key}: -1 is negative", "refuse"
    )
