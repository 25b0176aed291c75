"""`dynamo-snapshot dgd`: DynamoGraphDeployments between v1alpha1 and v1beta1, the version the CRD stores.

    dynamo-snapshot dgd convert examples/vllm/dgd-auto.yaml | kubectl apply -f -   # v1alpha1 -> v1beta1
    dynamo-snapshot dgd convert --to v1alpha1 dgd.yaml                             # and back
    dynamo-snapshot dgd migrate-storage                # after an upgrade: every DGD stored at v1beta1

`convert` prints every document of the files (or - for standard input) as YAML, each DynamoGraphDeployment
converted as the controller's webhook converts it (what one version cannot hold kept in the reserved
annotations nvidia.com/dgd-spec and nvidia.com/dgd-status), the others as they are: with crds/ alone the
cluster serves v1beta1 only. `migrate-storage` writes every DGD back unchanged, so the apiserver stores it
at v1beta1, then drops v1alpha1 from the CRD's status.storedVersions; DGDs written before the CRD stored
v1beta1 are read through the conversion webhook meanwhile, which must answer (the chart's controller).

Exit codes: 0 done, 1 failed (one line says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import yaml

from dynamo_snapshot.api.dgd_conversion import V1ALPHA1, V1BETA1, ConversionError, convert_object
from dynamo_snapshot.kube import ApiError, Kube, load_client
from dynamo_snapshot.kube.dgd_versions import migrate_storage

_KIND = "DynamoGraphDeployment"
_VERSIONS = {V1BETA1.rsplit("/", 1)[1]: V1BETA1, V1ALPHA1.rsplit("/", 1)[1]: V1ALPHA1}


def register(sub: Any) -> None:
    doc = (__doc__ or "").split("\n\n")
    p: argparse.ArgumentParser = sub.add_parser(
        "dgd",
        help="convert DynamoGraphDeployment manifests, migrate their storage to v1beta1",
        description=doc[0],
        epilog="\n\n".join(doc[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    convert = actions.add_parser("convert", help="print manifests with every DGD converted")
    convert.add_argument("files", nargs="+", help="YAML or JSON files, or - for standard input")
    convert.add_argument(
        "--to", choices=sorted(_VERSIONS), default="v1beta1", help="the version to write (default v1beta1)"
    )
    convert.set_defaults(run=run_convert)
    migrate = actions.add_parser("migrate-storage", help="store every DGD at v1beta1 again")
    migrate.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    migrate.set_defaults(run=run_migrate)


def _documents(name: str) -> list[Any]:
    text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d is not None]


def converted(documents: list[Any], to: str) -> list[Any]:
    """``documents`` with each DynamoGraphDeployment converted to ``to`` (an apiVersion); ConversionError
    names the one that cannot be."""
    out = []
    for index, document in enumerate(documents):
        if isinstance(document, dict) and document.get("kind") == _KIND:
            try:
                document = convert_object(document, to)
            except ConversionError as e:
                name = (document.get("metadata") or {}).get("name") or f"document {index + 1}"
                raise ConversionError(f"{_KIND} {name}: {e}") from None
        out.append(document)
    return out


def run_convert(args: argparse.Namespace) -> int:
    try:
        documents = [d for name in args.files for d in _documents(name)]
        result = converted(documents, _VERSIONS[args.to])
    except (OSError, yaml.YAMLError, ConversionError) as e:
        print(f"dynamo-snapshot dgd convert: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(result, sort_keys=False))
    return 0


async def _migrate(kubeconfig: str | None) -> str:
    async with await load_client(kubeconfig) as api:
        done = await migrate_storage(Kube(api, field_manager="dynamo-snapshot-migrate"))
    if done.before == done.after:
        return f"nothing to migrate: every DynamoGraphDeployment is stored at {', '.join(done.after)}"
    return (
        f"{done.rewritten} DynamoGraphDeployment(s) stored at {', '.join(done.after)}; "
        f"storedVersions {done.before} -> {done.after}"
    )


def run_migrate(args: argparse.Namespace) -> int:
    try:
        print(asyncio.run(_migrate(args.kubeconfig)))
    except (ApiError, OSError, ValueError) as e:
        print(f"dynamo-snapshot dgd migrate-storage: {e}", file=sys.stderr)
        return 1
    return 0
