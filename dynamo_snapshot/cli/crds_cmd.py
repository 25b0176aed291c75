"""`dynamo-snapshot crds`: print, write or check the CRD manifests generated from the API models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import crdgen


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "crds", help="print, write (--out) or check (--check) the CRDs"
    )
    p.add_argument("--out", type=Path, help="directory to write the CRD YAML files into")
    p.add_argument("--check", type=Path, metavar="DIR", help="exit 1 if DIR differs from the models")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.check:
        problems = crdgen.stale_files(args.check)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print(f"regenerate with: dynamo-snapshot crds --out {args.check}", file=sys.stderr)
        return 1 if problems else 0
    if args.out:
        crdgen.write_crds(args.out)
        return 0
    rendered = crdgen.render_crds()
    sys.stdout.write("---\n".join(rendered[n] for n in sorted(rendered)))
    return 0
