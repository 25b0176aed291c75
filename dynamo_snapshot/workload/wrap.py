"""``python -m dynamo_snapshot.workload.wrap --ready-url URL -- ENGINE [ARGS...]``: the workload contract for
an engine that knows nothing of it, such as a plain ``vllm serve``.

- In a restore pod (``SNAPSHOT_RESTORE_STANDBY=1``, which the restore webhook sets) it waits as the restore
  placeholder (``run_standby``) and never starts the engine: the node agent restores the checkpointed engine
  into the container.
- Otherwise it runs the engine as its child and, where the pod has a control directory (a SnapshotJob's or
  a DynamoCheckpoint's source pod), writes ``ready-for-snapshot`` once the engine answers ``URL`` with 200:
  the engine has loaded its model, compiled and captured its graphs, so it is worth checkpointing. SIGTERM
  and SIGINT go on to the engine; the wrapper exits with the engine's status.

The checkpoint takes the wrapper and the engine together; a restored wrapper goes on waiting for its engine.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from types import FrameType

from dynamo_snapshot.workload.handshake import SnapshotHandshake
from dynamo_snapshot.workload.standby import run_standby, standby_requested

__all__ = ["engine_ready", "main"]

_POLL_S = 1.0


def engine_ready(url: str, timeout: float = 2.0) -> bool:
    """Whether the engine answers ``url`` with 200 (anything else, or no answer: not yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_snapshot.workload.wrap",
        description="Run ENGINE under the snapshot workload contract.",
    )
    parser.add_argument(
        "--ready-url",
        required=True,
        help="the engine's health URL; 200 means it is ready to be checkpointed (e.g. http://127.0.0.1:8000/health)",
    )
    parser.add_argument("engine", nargs=argparse.REMAINDER, help="-- ENGINE [ARGS...]")
    args = parser.parse_args(argv)
    if args.engine[:1] == ["--"]:
        args.engine = args.engine[1:]
    if not args.engine:
        parser.error("no engine command given after --")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if standby_requested():
        return run_standby()
    handshake = SnapshotHandshake.maybe_from_env()
    engine = subprocess.Popen(args.engine)

    def forward(sig: int, _frame: FrameType | None) -> None:
        engine.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    signalled = handshake is None
    while True:
        try:
            status = engine.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            if not signalled and engine_ready(args.ready_url):
                assert handshake is not None
                handshake.signal_ready({"engine": args.engine[0], "readyUrl": args.ready_url})
                signalled = True
            continue
        # A negative status is a signal: report it as a shell would.
        return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
