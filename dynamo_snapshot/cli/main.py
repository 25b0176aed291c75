"""Entry point: `dynamo-snapshot <command>`. Exit codes: 0 ok, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from dynamo_snapshot import __version__
from dynamo_snapshot.cli import (
    agent_cmd,
    controller_cmd,
    crds_cmd,
    demo_absent,
    dgd_cmd,
    identity_cmd,
    podsnapshot_cmds,
    snapshot_cmds,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynamo-snapshot",
        description="Start GPU inference replicas in seconds by restoring a checkpointed worker.",
        epilog=(
            "first steps:\n"
            "  dynamo-snapshot demo                 the whole story on this machine (as root)\n"
            "  dynamo-snapshot identity dgd.yaml    the checkpoint identity hash of each service\n"
            "  dynamo-snapshot COMMAND --help       what a command does and its flags\n"
            "\nexit codes: 0 done, 1 failed (one line says why), 2 bad usage, 130 interrupted"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dynamo-snapshot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_demo(sub)
    controller_cmd.register(sub)
    agent_cmd.register(sub)
    snapshot_cmds.register(sub)
    podsnapshot_cmds.register(sub)
    identity_cmd.register(sub)
    crds_cmd.register(sub)
    dgd_cmd.register(sub)
    return parser


def _register_demo(sub: Any) -> None:
    """The demo where it is installed (a source checkout), else a `demo` that says it is not: the images
    leave the demo and the local cluster out, and every other command must work without them."""
    try:
        # Not `from dynamo_snapshot.cli import demo_cmd`: for a missing submodule that raises a plain
        # ImportError, which does not say which module is missing.
        demo_cmd = importlib.import_module("dynamo_snapshot.cli.demo_cmd")
    except ModuleNotFoundError as e:
        if not demo_absent.is_missing_demo(e):
            raise
        demo_absent.register(sub)
        return
    demo_cmd.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
