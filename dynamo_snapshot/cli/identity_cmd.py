"""`dynamo-snapshot identity FILE`: the 16-character checkpoint identity hash, as the controller and
Dynamo's operator compute it, for an identity file, a DynamoCheckpoint or a DynamoGraphDeployment.

    dynamo-snapshot identity identity.yaml                 # prints the hash
    dynamo-snapshot identity dgd.yaml                      # one line per Auto-mode service: NAME HASH
    dynamo-snapshot identity dgd.yaml --service VllmWorker # just that service's hash
    kubectl get dgd my-graph -o yaml | dynamo-snapshot identity -

Exit codes: 0 printed, 1 the file is not valid (the message names the field), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash


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
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        for line in hashes(text, args.service):
            print(line)
    except OSError as e:
        print(f"error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    except IdentityInputError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 1
    return 0


def hashes(text: str, service: str | None = None) -> list[str]:
    """The lines `identity` prints for a document."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise IdentityInputError(f"not YAML or JSON: {str(e).splitlines()[0]}") from None
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
        err = e.errors()[0]
        raise IdentityInputError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _dgd_hashes(dgd: DynamoGraphDeployment, service: str | None) -> list[str]:
    services = dgd.spec.services or {}
    if service is not None and service not in services:
        raise IdentityInputError(
            f"no service {service!r} (services: {', '.join(sorted(services)) or 'none'})"
        )
    # As the controller decides: a service with a checkpointRef restores from that checkpoint, whatever
    # identity it also names.
    found = {
        name: compute_identity_hash(identity)
        for name, svc in services.items()
        if svc.checkpoint is not None and (identity := svc.checkpoint.auto_identity) is not None
    }
    if service is not None:
        if service not in found:
            raise IdentityInputError(f"service {service!r} has no checkpoint identity (checkpointRef or off)")
        return [found[service]]
    if not found:
        raise IdentityInputError("no service has a checkpoint identity")
    return [f"{name} {h}" for name, h in sorted(found.items())]
