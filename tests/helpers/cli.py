"""The ``dynamo-snapshot`` command line as the tests run it: this interpreter, the working tree's code."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

CLI = (sys.executable, "-m", "dynamo_snapshot.cli.main")
# The dev harness's `dynamo-snapshot-demo`.
DEMO = (sys.executable, "-m", "dynamo_snapshot_dev.demo.command")


def run_cli(
    *args: str, timeout: float = 60, env: Mapping[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``dynamo-snapshot ARGS`` to its end, its output captured as text."""
    return subprocess.run(
        [*CLI, *args], input=input, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def run_demo(
    *args: str, timeout: float = 60, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``dynamo-snapshot-demo ARGS`` to its end, its output captured as text."""
    return subprocess.run(
        [*DEMO, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
