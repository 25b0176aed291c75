"""A Dynamo 1.6 worker run the way dynamo.vllm, dynamo.sglang and dynamo.trtllm run under Dynamo Snapshot,
with Dynamo's mocker engine (no GPU) in place of the model. Every snapshot step is Dynamo's own code from
the `ai-dynamo` wheel (`dynamo.common.snapshot`); this file only orders them as those backends do:

1. restore pod in standby (`SNAPSHOT_RESTORE_STANDBY=1`): `maybe_run_restore_standby_mode()` writes
   restore-context.json and execs `sleep infinity`, the placeholder the node agent restores into;
2. otherwise the engine's configuration is prepared before any runtime connection exists;
3. in a snapshot pod (`DYN_SNAPSHOT_CONTROL_DIR` set) `SnapshotConfig.run_lifecycle()` writes
   ready-for-snapshot and waits: snapshot-complete (the checkpoint is taken) ends this source with 0,
   restore-complete (this is a restored copy) continues;
4. a restored copy applies restore-context.json (`apply_snapshot_restore_env`), parses its runtime
   settings again from that environment and wakes (`elect_and_wake`);
5. then, as `python -m dynamo.mocker` does, the runtime is created and the mocker engine registers and
   serves.

Arguments are the mocker's (`python -m dynamo.mocker --help`). Needs the `ai-dynamo` and
`ai-dynamo-runtime` wheels on the path (scripts/dynamo-wheels.sh installs them for the tests).
"""

from __future__ import annotations

from dynamo.common.snapshot.restore_context import (
    apply_snapshot_restore_env,
    maybe_run_restore_standby_mode,
)

if __name__ == "__main__":
    maybe_run_restore_standby_mode()  # never returns in standby: the process becomes `sleep infinity`

import logging
import sys

import uvloop
from dynamo.common.snapshot.lifecycle import (
    SnapshotConfig,
    configure_snapshot_capture_env,
    elect_and_wake,
)
from dynamo.mocker.args import parse_args
from dynamo.mocker.config import apply_worker_engine_args_overrides, load_mocker_engine_args
from dynamo.mocker.main import launch_workers
from dynamo.mocker.utils.kv_cache import compute_kv_bytes_per_token

log = logging.getLogger("dynamo_mocker_worker")


class NothingToPause:
    """The mocker's engine only exists with its runtime: before the checkpoint nothing runs to pause."""

    async def pause(self, *_args: object) -> None:
        return None

    async def resume(self) -> None:
        return None

    def mark_resumed(self) -> None:
        return None


async def worker() -> int:
    args = parse_args()
    if args.kv_bytes_per_token is None and args.model_path:
        args.kv_bytes_per_token = compute_kv_bytes_per_token(args.model_path, args.kv_cache_dtype)
    engine_args = apply_worker_engine_args_overrides(
        load_mocker_engine_args(args), kv_bytes_per_token=args.kv_bytes_per_token
    )
    snapshot = SnapshotConfig.from_env()
    if snapshot is not None:
        configure_snapshot_capture_env()
        controller = NothingToPause()
        if not await snapshot.run_lifecycle(controller):
            log.info("checkpoint taken (snapshot-complete): this source worker ends")
            return 0
        apply_snapshot_restore_env()
        args = parse_args()  # the runtime settings as the restore pod's environment says
        await elect_and_wake(controller)
    await launch_workers(args, engine_args)
    return 0


if __name__ == "__main__":
    sys.exit(uvloop.run(worker()))
