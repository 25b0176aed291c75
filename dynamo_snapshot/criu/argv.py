"""CRIU command lines as pure functions, so every flag choice is unit-testable without CRIU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_TREE_OPTIONS", "LOG_VERBOSITY", "TreeOptions", "dump_argv", "restore_argv"]

# -v4 is CRIU's debug level: a failed dump of a real worker is only diagnosable with it, and the log
# goes to a file, so the cost is disk, not terminal noise.
LOG_VERBOSITY = "-v4"


@dataclass(frozen=True)
class TreeOptions:
    """How the tree's open resources are handled: what a dump was made with, its restore must repeat,
    so both take one of these."""

    ext_unix_sk: bool = True  # unix sockets whose peer is outside the tree
    file_locks: bool = True
    tcp_established: bool = False  # only where the restore keeps the IP (CRIU 4.1.1: Linux < 6.16)
    shell_job: bool = False  # the root shares the caller's session/terminal

    def flags(self) -> list[str]:
        chosen = (
            (self.ext_unix_sk, "--ext-unix-sk"),
            (self.file_locks, "--file-locks"),
            (self.tcp_established, "--tcp-established"),
            (self.shell_job, "--shell-job"),
        )
        return [flag for on, flag in chosen if on]


DEFAULT_TREE_OPTIONS = TreeOptions()


def _common(images_dir: Path, work_dir: Path, log_file: str, options: TreeOptions) -> list[str]:
    # Absolute paths: CRIU resolves relative ones against its work dir, not our cwd.
    return [
        "-D",
        str(images_dir.absolute()),
        "-W",
        str(work_dir.absolute()),
        "-o",
        log_file,
        LOG_VERBOSITY,
        *options.flags(),
    ]


def dump_argv(
    pid: int,
    images_dir: Path,
    *,
    work_dir: Path | None = None,
    log_file: str = "dump.log",
    leave_running: bool = False,
    options: TreeOptions = DEFAULT_TREE_OPTIONS,
    link_remap: bool = True,
    ghost_limit: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Arguments after the binary for ``criu dump`` of the process tree rooted at ``pid``.

    CRIU always dumps the whole tree under ``pid`` (``-t``); there is no single-process mode.
    """
    if pid <= 0:
        raise ValueError(f"invalid pid {pid}")
    if ghost_limit is not None and ghost_limit < 0:
        raise ValueError(f"invalid ghost_limit {ghost_limit}")
    argv = ["dump", "-t", str(pid)]
    argv += _common(images_dir, work_dir or images_dir, log_file, options)
    if leave_running:
        argv.append("--leave-running")
    if link_remap:
        argv.append("--link-remap")
    if ghost_limit is not None:
        argv += ["--ghost-limit", str(ghost_limit)]
    return [*argv, *extra_args]


def restore_argv(
    images_dir: Path,
    pidfile: Path,
    *,
    work_dir: Path | None = None,
    log_file: str = "restore.log",
    detach: bool = True,
    restore_sibling: bool = False,
    leave_stopped: bool = False,
    options: TreeOptions = DEFAULT_TREE_OPTIONS,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Arguments after the binary for ``criu restore``; ``pidfile`` receives the restored root's pid.
    With ``leave_stopped`` every restored task stays stopped (SIGSTOP) until someone sends SIGCONT.

    ``options`` must be the dump's.
    """
    argv = ["restore"]
    argv += _common(images_dir, work_dir or images_dir, log_file, options)
    argv += ["--pidfile", str(pidfile.absolute())]
    if detach:
        argv.append("--restore-detached")
    if restore_sibling:
        argv.append("--restore-sibling")
    if leave_stopped:
        argv.append("--leave-stopped")
    return [*argv, *extra_args]
