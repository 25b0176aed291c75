"""The `demo` command where the local demo is not installed.

The controller and agent images hold production code only: the demo (`cli/demo_cmd.py`, `cli/demo/`) and the
local cluster it runs on (`localcluster/`) are left out of them. There `dynamo-snapshot demo` says so in one
line and exits with the usage code, and every other command works as in a source checkout.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

NOT_INSTALLED = (
    "the local demo is not part of this installation: install from a source checkout "
    "(pip install -e . in a clone of the repository) to run it"
)
EXIT_USAGE = 2
# What a checkout has and an image does not.
DEMO_MODULES = ("dynamo_snapshot.cli.demo_cmd", "dynamo_snapshot.cli.demo", "dynamo_snapshot.localcluster")


def is_missing_demo(error: ModuleNotFoundError) -> bool:
    """Whether `error` is about a demo-only module (anything else missing is a real fault)."""
    name = error.name or ""
    return any(name == m or name.startswith(m + ".") for m in DEMO_MODULES)


def not_installed(_args: argparse.Namespace | None = None) -> int:
    print(f"dynamo-snapshot: {NOT_INSTALLED}", file=sys.stderr)
    return EXIT_USAGE


def register(sub: Any) -> None:
    """A `demo` that takes any arguments (`--help` included) and answers `not_installed`."""
    # No option prefix: every argument, `--quick` or `--help` alike, is one of the positionals it ignores.
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="run the local demo (not part of this installation)", add_help=False, prefix_chars="\0"
    )
    p.add_argument("ignored", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(run=not_installed)
