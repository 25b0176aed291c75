"""Entry point: `dynamo-snapshot <command>`. Exit codes: 0 ok, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dynamo_snapshot import __version__
from dynamo_snapshot.cli import (
    agent_cmd,
    controller_cmd,
    crds_cmd,
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
            "  dynamo-snapshot identity dgd.yaml    the checkpoint identity hash of each service\n"
            "  dynamo-snapshot COMMAND --help       what a command does and its flags\n"
            "\nexit codes: 0 done, 1 failed (one line says why), 2 bad usage, 130 interrupted"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dynamo-snapshot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    controller_cmd.register(sub)
    agent_cmd.register(sub)
    snapshot_cmds.register(sub)
    podsnapshot_cmds.register(sub)
    identity_cmd.register(sub)
    crds_cmd.register(sub)
    dgd_cmd.register(sub)
    return parser


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
