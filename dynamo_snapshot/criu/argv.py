"""CRIU command lines as pure functions, so every flag choice is unit-testable without CRIU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["LOG_VERBOSITY", "dump_argv", "restore_argv"]

# -v4 is CRIU's debug level: a failed dump of a real worker is only diagnosable with it, and the log
# goes to a file, so the cost is disk, not terminal noise.
LOG_VERBOSITY = "-v4"


def _common(
    images_dir: Path,
    work_dir: Path,
    log_file: str,
    *,
    ext_unix_sk: bool,
    file_locks: bool,
    tcp_established: bool,
    shell_job: bool,
) -> list[str]:
    # Absolute paths: CRIU resolves relative ones against its work dir, not our cwd.
    argv = ["-D", str(images_dir.absolute()), "-W", str(work_dir.absolute()), "-o", log_file, LOG_VERBOSITY]
    if ext_unix_sk:
        argv.append("--ext-unix-sk")
    if file_locks:
        argv.append("--file-locks")
    if tcp_established:
        argv.append("--tcp-established")
    if shell_job:
        argv.append("--shell-job")
    return argv


def dump_argv(
    pid: int,
    images_dir: Path,
    *,
    work_dir: Path | None = None,
    log_file: str = "dump.log",
    leave_running: bool = False,
    ext_unix_sk: bool = True,
    file_locks: bool = True,
    link_remap: bool = True,
    tcp_established: bool = False,
    shell_job: bool = False,
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
    argv += _common(
        images_dir,
        work_dir or images_dir,
        log_file,
        ext_unix_sk=ext_unix_sk,
        file_locks=file_locks,
        tcp_established=tcp_established,
        shell_job=shell_job,
    )
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
    ext_unix_sk: bool = True,
    file_locks: bool = True,
    tcp_established: bool = False,
    shell_job: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Arguments after the binary for ``criu restore``; ``pidfile`` receives the restored root's pid.
    With ``leave_stopped`` every restored task stays stopped (SIGSTOP) until someone sends SIGCONT.

    ``ext_unix_sk``, ``file_locks``, ``tcp_established`` and ``shell_job`` must match the dump.
    """
    argv = ["restore"]
    argv += _common(
        images_dir,
        work_dir or images_dir,
        log_file,
        ext_unix_sk=ext_unix_sk,
        file_locks=file_locks,
        tcp_established=tcp_established,
        shell_job=shell_job,
    )
    argv += ["--pidfile", str(pidfile.absolute())]
    if detach:
        argv.append("--restore-detached")
    if restore_sibling:
        argv.append("--restore-sibling")
    if leave_stopped:
        argv.append("--leave-stopped")
    return [*argv, *extra_args]
