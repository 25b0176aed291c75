"""CRIU invocation: find the binary, check its version, dump and restore process trees.

    criu = Criu()                                   # explicit path, $DYNSNAP_CRIU, PATH
    criu = Criu(kept_logs=dir)                      # a failed run's log kept there (kept_logs)
    criu = Criu(restore_huge_pages=False)           # restores fill dense memory 4 KiB at a time
    criu = Criu(restore_readers=8)                  # each restored task's pages read by 8 threads
    await criu.require(min=(4, 0)) -> CriuVersion   # CriuError("CRIU 3.17 is too old: ...")
    await criu.check() -> str                       # "Looks good." or CriuError
    await criu.dump(pid, images_dir, *, log_dir=None, leave_running=False, options=TreeOptions(),
                    link_remap=True, ghost_limit=None, extra_args=())
        -> DumpResult(seconds, log_path, image_bytes)
    await criu.restore(images_dir, *, log_dir=None, pidfile=None, detach=True, restore_sibling=False,
                       leave_stopped=False, options=TreeOptions(), extra_args=())
        -> RestoreResult(pid, seconds, log_path)

TreeOptions (unix sockets, file locks, TCP, shell job) is one value for both: a restore must repeat the
dump's choices.

Every failure is a ``CriuError`` whose text quotes the relevant lines of CRIU's -v4 log.
``dump_argv``/``restore_argv`` build the command lines as pure functions.
"""

from dynamo_snapshot.criu.argv import TreeOptions, dump_argv, restore_argv
from dynamo_snapshot.criu.errors import CriuError
from dynamo_snapshot.criu.runner import (
    ENV_CRIU,
    MIN_VERSION,
    RESTORE_READERS_MAX,
    Criu,
    DumpResult,
    RestoreResult,
    find_criu,
)
from dynamo_snapshot.criu.version import CriuVersion

__all__ = [
    "ENV_CRIU",
    "MIN_VERSION",
    "RESTORE_READERS_MAX",
    "Criu",
    "CriuError",
    "CriuVersion",
    "DumpResult",
    "RestoreResult",
    "TreeOptions",
    "dump_argv",
    "find_criu",
    "restore_argv",
]
