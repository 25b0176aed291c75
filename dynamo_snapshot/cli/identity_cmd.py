"""`dynamo-snapshot identity FILE`: the 16-character checkpoint identity hash, as the controller and
Dynamo's operator compute it, for an identity file, a DynamoCheckpoint or a DynamoGraphDeployment.

    dynamo-snapshot identity identity.yaml                 # prints the hash
    dynamo-snapshot identity dgd.yaml                      # one line per Auto-mode service: NAME HASH
    dynamo-snapshot identity dgd.yaml --service VllmWorker # just that service's hash
    kubectl get dgd my-graph -o yaml | dynamo-snapshot identity -

A file is read as kubectl reads a manifest, so the hash is the one of the object `kubectl apply -f FILE`
stores: bytes that are not UTF-8 become U+FFFD (or, after a UTF-8 byte-order mark, are left to the JSON
reader, which replaces them too, and the YAML reader, which refuses them), a UTF-16 byte-order mark makes
it UTF-16; a JSON document is then decoded as Go's encoding/json decodes it (an escaped surrogate pair is
its character, any other surrogate escape U+FFFD) and anything else as YAML, which like kubectl refuses
surrogate escapes. YAML aliases are read as kubectl reads them, up to 10000 nodes of expansion, and
no document may nest deeper than 100 levels: past either, the file is refused before it is expanded.
A negative parallel size or maxModelLen is refused, as both CRDs refuse it, so no hash is printed
for an identity no cluster can hold.

Exit codes: 0 printed, 1 the file is not valid (the message names the field), 2 bad usage.
"""

from __future__ import annotations

import argparse
import codecs
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.gojson import go_unmarshal
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, checkpoint_identity
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.cli.bounded_yaml import MAX_DEPTH, YAMLTooLarge, safe_load_bounded


class IdentityInputError(ValueError):
    """What is wrong with the input, in one line."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "identity",
        help="print the checkpoint identity hash of an identity, DynamoCheckpoint or DGD file",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", help="YAML or JSON file, or - for standard input")
    p.add_argument("--service", help="in a DGD: print only this service's hash")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        for line in hashes(data, args.service):
            print(line)
    except OSError as e:
        print(f"error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    except IdentityInputError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 1
    return 0


_SURROGATE = re.compile("[\ud800-\udfff]")


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string of a document, keys included, with where it is."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            yield from _strings(key, where)
            yield from _strings(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _strings(value, f"{path}.{index}" if path else str(index))


def _utf16_like_kubectl(data: bytes, byteorder: Literal["big", "little"]) -> str:
    """UTF-16 as golang.org/x/text's decoder reads it, ill-formed input included: a surrogate followed by a
    low surrogate is read as one pair (U+FFFD unless it is a valid one), any other surrogate and a
    trailing odd byte as U+FFFD."""
    out: list[str] = []
    index = 0
    while index < len(data):
        if index + 1 == len(data):
            out.append("\ufffd")
            break
        unit = int.from_bytes(data[index : index + 2], byteorder)
        size = 2
        if 0xD800 <= unit <= 0xDFFF and index + 3 < len(data):
            low = int.from_bytes(data[index + 2 : index + 4], byteorder)
            if 0xDC00 <= low <= 0xDFFF:
                size = 4
                unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00) if unit < 0xDC00 else 0xFFFD
        out.append("\ufffd" if 0xD800 <= unit <= 0xDFFF else chr(unit))
        index += size
    return "".join(out)


def _read_like_kubectl(data: bytes) -> str:
    """The text kubectl reads from a manifest file: k8s.io/cli-runtime's FileVisitor reads it through
    golang.org/x/text's ``BOMOverride(UTF8.NewDecoder())``. Without a byte-order mark every ill-formed
    UTF-8 subsequence becomes one U+FFFD, Unicode's "maximal subpart" rule that Python's "replace" follows
    too; after a UTF-8 mark the bytes are passed on as they are (here as surrogateescape)."""
    if data.startswith(codecs.BOM_UTF8):
        return data[len(codecs.BOM_UTF8) :].decode("utf-8", "surrogateescape")
    if data.startswith(codecs.BOM_UTF16_BE):
        return _utf16_like_kubectl(data[2:], "big")
    if data.startswith(codecs.BOM_UTF16_LE):
        return _utf16_like_kubectl(data[2:], "little")
    return data.decode("utf-8", "replace")


_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels; no identity, DynamoCheckpoint or DGD nests that deep"


def _shallow(doc: Any) -> Any:
    """``doc``, if it nests no deeper than YAML documents may here (a JSON document has no aliases, so
    its size is the file's)."""
    level: list[Any] = [doc]
    for _ in range(MAX_DEPTH):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return doc
    raise IdentityInputError(_TOO_DEEP)


def load_document(data: str | bytes) -> Any:
    """The document as Dynamo's operator gets it once ``kubectl apply`` has sent it: JSON through Go's
    decoding, anything else as YAML."""
    text = _read_like_kubectl(data) if isinstance(data, bytes) else data
    try:
        return _shallow(go_unmarshal(text))
    except RecursionError:
        raise IdentityInputError(_TOO_DEEP) from None
    except ValueError:
        pass  # not JSON, so YAML
    raw = _SURROGATE.search(text)
    if raw is not None and isinstance(data, bytes):
        offset = len(text[: raw.start()].encode("utf-8", "surrogateescape"))
        raise IdentityInputError(
            f"not UTF-8: byte 0x{ord(raw.group()) - 0xDC00:02x} at offset {offset} after the byte-order "
            "mark (YAML must be UTF-8; kubectl refuses this file too)"
        )
    try:
        doc = safe_load_bounded(text)
    except YAMLTooLarge as e:
        raise IdentityInputError(str(e)) from None
    except yaml.YAMLError as e:
        raise IdentityInputError(f"not YAML or JSON: {str(e).splitlines()[0]}") from None
    for where, value in _strings(doc):
        half = _SURROGATE.search(value)
        if half is not None:
            raise IdentityInputError(
                f"{where}: \\u{ord(half.group()):04x} is half of a UTF-16 surrogate pair, which YAML (as "
                "kubectl reads it) does not take; write the character itself, \\U0001F600 style, or "
                "give the document as JSON"
            )
    return doc


def hashes(data: str | bytes, service: str | None = None) -> list[str]:
    """The lines `identity` prints for a document."""
    doc = load_document(data)
    if not isinstance(doc, dict):
        raise IdentityInputError("expected a mapping (an identity, a DynamoCheckpoint or a DGD)")
    kind = doc.get("kind")
    try:
        if kind == "DynamoGraphDeployment":
            return _dgd_hashes(DynamoGraphDeployment.model_validate(doc), service)
        if service:
            raise IdentityInputError("--service applies to a DynamoGraphDeployment only")
        if kind == "DynamoCheckpoint":
            return [compute_identity_hash(DynamoCheckpoint.model_validate(doc).spec.identity)]
        if kind:
            raise IdentityInputError(f"kind {kind} has no checkpoint identity")
        return [compute_identity_hash(CheckpointIdentity.model_validate(doc))]
    except ValidationError as e:
        raise IdentityInputError(_validation_message(e.errors()[0])) from None


_SIZES = ("tensorParallelSize", "pipelineParallelSize", "maxModelLen")


def _validation_message(err: Any) -> str:
    where = ".".join(map(str, err["loc"]))
    value = err.get("input")
    if err["loc"] and err["loc"][-1] in _SIZES and isinstance(value, int) and value < 0:
        # Go's ComputeIdentityHash would hash the number as it is, but it is never given one: Dynamo's
        # CRD (minimum 1) and this project's (minimum 0) refuse it, so no stored object has this hash.
        return (
            f"{where}: {value} is negative, which Dynamo's CRD and this one refuse, so no checkpoint or "
            "DGD can have this identity and it has no hash"
        )
    return f"{where}: {err['msg']}"


def _dgd_hashes(dgd: DynamoGraphDeployment, service: str | None) -> list[str]:
    services = dgd.spec.services or {}
    if service is not None and service not in services:
        raise IdentityInputError(
            f"no service {service!r} (services: {', '.join(sorted(services)) or 'none'})"
        )
    # As the controller decides: a service with a checkpointRef restores from that checkpoint, whatever
    # identity it also names.
    found = {
        name: compute_identity_hash(checkpoint_identity(dgd.spec, name))
        for name, svc in services.items()
        if svc.checkpoint is not None and svc.checkpoint.auto
    }
    if service is not None:
        if service not in found:
            raise IdentityInputError(f"service {service!r} has no checkpoint identity (checkpointRef or off)")
        return [found[service]]
    if not found:
        raise IdentityInputError("no service has a checkpoint identity")
    return [f"{name} {h}" for name, h in sorted(found.items())]
