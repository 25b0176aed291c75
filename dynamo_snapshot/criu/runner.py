"""Running the CRIU binary from asyncio: finding it, checking its version, dump, restore and check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.criu.argv import DEFAULT_TREE_OPTIONS, TreeOptions, dump_argv, restore_argv
from dynamo_snapshot.criu.errors import CriuError, known_cause, log_excerpt, summary_line
from dynamo_snapshot.criu.kept_logs import keep_log
from dynamo_snapshot.criu.version import CriuVersion

__all__ = [
    "ENV_CRIU",
    "MIN_VERSION",
    "RESTORE_HUGE_PAGES_ENV",
    "RESTORE_READERS_ENV",
    "RESTORE_READERS_MAX",
    "Criu",
    "DumpResult",
    "RestoreResult",
    "find_criu",
]

log = logging.getLogger(__name__)

ENV_CRIU = "DYNSNAP_CRIU"
# Debian 12's CRIU 3.17 cannot restore on current kernels (vDSO layout), so 4.0 is the floor.
MIN_VERSION = (4, 0)
# Read by CRIU built with scripts/criu-restore-thp.patch: its restorer advises huge pages for the private
# anonymous mappings of 2 MiB or more that the images fill to half or more, before reading them in.
RESTORE_HUGE_PAGES_ENV = "CRIU_RESTORE_THP_DENSE"
# Read by CRIU built with scripts/criu-restore-readers.patch: each task's restorer reads its pages with this
# many threads at once (page faults in fresh memory are taken one core per thread).
RESTORE_READERS_ENV = "CRIU_RESTORE_READERS"
RESTORE_READERS_MAX = 64


@dataclass(frozen=True)
class DumpResult:
    seconds: float
    log_path: Path
    image_bytes: int


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    seconds: float
    log_path: Path


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_criu(binary: Path | None = None) -> Path:
    """The CRIU binary: ``binary``, else ``$DYNSNAP_CRIU``, else ``PATH`` (where scripts/pyenv.sh puts the
    component cache that scripts/test-env.sh fills).

    An explicit choice that is wrong is an error rather than a reason to look further, so a
    misconfigured agent never silently runs some other CRIU.
    """
    if binary is not None:
        if not _executable(binary):
            raise CriuError("find", None, f"criu not found: {binary} is not an executable file")
        return binary
    env = os.environ.get(ENV_CRIU)
    if env:
        if not _executable(Path(env)):
            raise CriuError("find", None, f"criu not found: ${ENV_CRIU}={env} is not an executable file")
        return Path(env)
    on_path = shutil.which("criu")
    if on_path:
        return Path(on_path)
    raise CriuError(
        "find",
        None,
        f"criu not found: neither ${ENV_CRIU} nor PATH names one (install CRIU >= 4, or run "
        "scripts/test-env.sh and source scripts/pyenv.sh, which puts its build on PATH)",
    )


async def _run(
    binary: Path,
    op: str,
    argv: Sequence[str],
    *,
    wrapper: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    env: Mapping[str, str | None] | None = None,
) -> tuple[int, str]:
    """Run CRIU to completion and return its exit status and combined stdout/stderr. `env`: variables
    set over the agent's own (None: removed).

    Output goes to an anonymous file, not a pipe: a restored process tree could inherit a pipe end
    and keep it open long after CRIU exits, and waiting for EOF would then hang. A memfd, not a file
    under /tmp: creating one touches no filesystem, so it cannot wait behind a restore's bulk reads
    (this runs on the event loop).
    """
    with open(os.memfd_create("criu-output", os.MFD_CLOEXEC), "w+b") as out:  # noqa: ASYNC230 - memory
        try:
            proc = await asyncio.create_subprocess_exec(
                *wrapper,
                str(binary),
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=tuple(pass_fds),
                env=_environment(env) if env else None,
            )
        except OSError as e:
            raise CriuError(op, None, f"cannot run {binary}: {e}") from e
        try:
            returncode = await proc.wait()
        except asyncio.CancelledError:
            # Never leave CRIU running unobserved: a half-done restore would resurrect half a tree.
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        out.seek(0)
        return returncode, out.read().decode(errors="replace")


def _failure(
    op: str, returncode: int, output: str, log_path: Path | None, kept_logs: Path | None = None
) -> CriuError:
    text = output
    if log_path is not None:
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            log_path = None  # CRIU failed before opening its log; its stderr says why
    if log_path is not None and kept_logs is not None:
        try:
            log_path = keep_log(log_path, kept_logs, op)
        except OSError as e:
            # The message still names the log where CRIU wrote it, which may outlive the failure.
            log.warning("a failed CRIU run's log was not kept", extra={"log": str(log_path), "error": str(e)})
    excerpt = log_excerpt(text)
    message = (
        known_cause(text)
        or summary_line(excerpt)
        or (excerpt[-1] if excerpt else f"no output, exit code {returncode}")
    )
    return CriuError(op, returncode, message, excerpt, log_path=log_path)


def _image_bytes(images_dir: Path, skip: Path) -> int:
    total = 0
    for entry in os.scandir(images_dir):
        if entry.is_file(follow_symlinks=False) and Path(entry.path) != skip:
            total += entry.stat(follow_symlinks=False).st_size
    return total


def _prepare_restore(log_dir: Path, pidfile: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    # CRIU creates the pidfile with O_EXCL, so a stale one from an earlier restore would fail this one.
    pidfile.unlink(missing_ok=True)


# A wrapper script's directory (a relocatable bundle: binary + lib/) is read whole up to this size.
_BUNDLE_MAX_BYTES = 128 << 20
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def parse_ldd(output: str) -> list[Path]:
    """The resolved library paths in ``ldd``'s output (the loader included; vdso and "not found" not)."""
    return [Path(m.group(1)) for m in map(_LDD_PATH.search, output.splitlines()) if m]


def _bundle_files(directory: Path) -> list[Path]:
    files: list[Path] = []
    total = 0
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            p = Path(root) / name
            with contextlib.suppress(OSError):
                if p.is_file() and not p.is_symlink():
                    total += p.stat().st_size
                    if total > _BUNDLE_MAX_BYTES:
                        return files
                    files.append(p)
    return files


def shebang_interpreter(first_line: bytes) -> Path | None:
    """The program a script's ``#!`` line runs, if it exists (for ``#!/usr/bin/env X``: X on PATH)."""
    words = first_line[2:].decode(errors="replace").split()
    if not words:
        return None
    path = Path(words[0])
    if path.name == "env" and len(words) > 1:
        found = shutil.which(words[1])
        path = Path(found) if found else path
    return path if path.is_absolute() and path.is_file() else None


async def _with_libraries(program: Path) -> list[Path]:
    found = [program]
    ldd = shutil.which("ldd")
    if ldd is not None:
        proc = await asyncio.create_subprocess_exec(
            ldd, str(program), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        out, _ = await proc.communicate()
        found += parse_ldd(out.decode(errors="replace"))
    return found


class Criu:
    """One CRIU binary; every operation runs it as a subprocess without blocking the event loop."""

    def __init__(
        self,
        binary: Path | None = None,
        *,
        kept_logs: Path | None = None,
        restore_huge_pages: bool = True,
        restore_readers: int = 8,
    ) -> None:
        """`kept_logs`: where the log of a failed dump or restore is kept (see kept_logs), for callers
        that remove the operation's work directory after a failure; None leaves it where CRIU wrote it.
        `restore_huge_pages`: restores advise transparent huge pages for the private anonymous memory
        they fill densely, before filling it (RESTORE_HUGE_PAGES_ENV; a CRIU built without the
        project's scripts/criu-restore-thp.patch ignores it); False fills it 4 KiB at a time.
        `restore_readers`: threads each restored task reads its pages with (RESTORE_READERS_ENV; a CRIU
        without scripts/criu-restore-readers.patch reads them with one)."""
        if not 1 <= restore_readers <= RESTORE_READERS_MAX:
            raise ValueError(f"restore_readers must be 1 to {RESTORE_READERS_MAX}, not {restore_readers}")
        self._requested = binary
        self.kept_logs = kept_logs
        self.restore_huge_pages = restore_huge_pages
        self.restore_readers = restore_readers
        self._binary: Path | None = None
        self._version: CriuVersion | None = None
        self._files: list[Path] | None = None

    async def files(self) -> list[Path]:
        """The files a CRIU run reads besides its images: the binary and its shared libraries (where the
        binary is a wrapper script: its interpreter and that one's libraries, and the bundle's
        directory). A restore reads them before its bulk I/O, so that CRIU's start-up reads do not queue
        behind it (benchmarks/criu_phase.py: CRIU's start-up behind a 2 GiB weights check 0.35-0.49 s
        without, 0.01 s with)."""
        if self._files is None:
            binary = self.binary
            with open(binary, "rb") as f:  # noqa: ASYNC230 - the first line of a local file
                first = f.readline(256)
            if first.startswith(b"#!"):
                interpreter = shebang_interpreter(first)
                found = await _with_libraries(interpreter) if interpreter is not None else []
                self._files = found + await asyncio.to_thread(_bundle_files, binary.parent)
            else:
                self._files = await _with_libraries(binary)
        return self._files

    @property
    def binary(self) -> Path:
        """The resolved binary (see ``find_criu``); raises ``CriuError`` when there is none."""
        if self._binary is None:
            self._binary = find_criu(self._requested)
        return self._binary

    async def version(self) -> CriuVersion:
        if self._version is None:
            returncode, output = await _run(self.binary, "version", ["--version"])
            if returncode != 0:
                raise _failure("version", returncode, output, None)
            try:
                self._version = CriuVersion.parse(output)
            except ValueError as e:
                raise CriuError("version", returncode, f"{self.binary}: {e}") from e
        return self._version

    async def require(self, min: tuple[int, ...] = MIN_VERSION) -> CriuVersion:
        """The version, or a one-line ``CriuError`` when CRIU is missing or older than ``min``."""
        version = await self.version()
        if not version.at_least(min):
            need = ".".join(map(str, min))
            why = f" ({version} fails on this kernel's vDSO)" if version.major < 4 else ""
            raise CriuError("version", None, f"CRIU {version} is too old: need >= {need}{why}")
        return version

    async def check(self) -> str:
        """``criu check``'s output when it says "Looks good"; otherwise ``CriuError`` quoting it."""
        returncode, output = await _run(self.binary, "check", ["check"])
        if returncode != 0 or "Looks good" not in output:
            raise _failure("check", returncode, output, None)
        return output.strip()

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        log_dir: Path | None = None,
        leave_running: bool = False,
        options: TreeOptions = DEFAULT_TREE_OPTIONS,
        link_remap: bool = True,
        ghost_limit: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> DumpResult:
        """Checkpoint the process tree rooted at ``pid`` into ``images_dir`` (created if missing).

        Unless ``leave_running``, CRIU kills the tree once it is dumped.  Without ``shell_job`` the
        root must lead its own session (e.g. started with ``start_new_session=True``).
        """
        work_dir = log_dir or images_dir
        log_path = work_dir / "dump.log"
        await asyncio.to_thread(_make_dirs, images_dir, work_dir)
        argv = dump_argv(
            pid,
            images_dir,
            work_dir=work_dir,
            log_file=log_path.name,
            leave_running=leave_running,
            options=options,
            link_remap=link_remap,
            ghost_limit=ghost_limit,
            extra_args=extra_args,
        )
        started = time.monotonic()
        returncode, output = await _run(self.binary, "dump", argv)
        seconds = time.monotonic() - started
        if returncode != 0:
            raise await asyncio.to_thread(_failure, "dump", returncode, output, log_path, self.kept_logs)
        image_bytes = await asyncio.to_thread(_image_bytes, images_dir, log_path)
        return DumpResult(seconds=seconds, log_path=log_path, image_bytes=image_bytes)

    async def restore(
        self,
        images_dir: Path,
        *,
        log_dir: Path | None = None,
        pidfile: Path | None = None,
        detach: bool = True,
        restore_sibling: bool = False,
        leave_stopped: bool = False,
        options: TreeOptions = DEFAULT_TREE_OPTIONS,
        extra_args: Sequence[str] = (),
        wrapper: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> RestoreResult:
        """Restore the tree dumped in ``images_dir``; it comes back with its original pids.

        With ``detach`` (the default) CRIU returns once the tree runs; without it, only when the tree
        exits.  Give ``log_dir`` when ``images_dir`` is read-only or must stay as it was verified:
        CRIU writes its log, stats and the pidfile there. ``wrapper`` runs CRIU (a command line that
        ends by exec'ing its arguments: entering a container's namespaces, say) and ``pass_fds`` are
        descriptors CRIU inherits (for ``--inherit-fd``); the pidfile then holds the pid CRIU saw.
        """
        work_dir = log_dir or images_dir
        log_path = work_dir / "restore.log"
        pidfile = pidfile or work_dir / "restore.pid"
        await asyncio.to_thread(_prepare_restore, work_dir, pidfile)
        argv = restore_argv(
            images_dir,
            pidfile,
            work_dir=work_dir,
            log_file=log_path.name,
            detach=detach,
            restore_sibling=restore_sibling,
            leave_stopped=leave_stopped,
            options=options,
            extra_args=extra_args,
        )
        started = time.monotonic()
        returncode, output = await _run(
            self.binary, "restore", argv, wrapper=wrapper, pass_fds=pass_fds, env=self._restore_env()
        )
        seconds = time.monotonic() - started
        if returncode != 0:
            raise await asyncio.to_thread(_failure, "restore", returncode, output, log_path, self.kept_logs)
        try:
            pid = int((await asyncio.to_thread(pidfile.read_text)).strip())
        except (OSError, ValueError) as e:
            raise CriuError(
                "restore", returncode, f"CRIU succeeded but left no usable pidfile {pidfile}: {e}"
            ) from e
        return RestoreResult(pid=pid, seconds=seconds, log_path=log_path)

    async def lazy_pages_daemon(
        self, images_dir: Path, work_dir: Path, ps_socket: int, *, within: float = 10.0
    ) -> asyncio.subprocess.Process:
        """A ``criu lazy-pages`` daemon for one restore with ``--lazy-pages`` and ``log_dir=work_dir``: it
        fills the restored memory with pages it asks for on ``ps_socket`` (``criu.page_server``), reading
        only the pagemaps of ``images_dir``. Returned once it listens for the restore; its log is
        ``work_dir/lazy-pages.log``, and it exits once every page moved."""
        socket_path = work_dir / "lazy-pages.socket"
        await asyncio.to_thread(_fresh_lazy_socket, work_dir, socket_path)
        quiet = asyncio.subprocess.DEVNULL
        daemon = await asyncio.create_subprocess_exec(
            str(self.binary), "lazy-pages", "--page-server", "--ps-socket", str(ps_socket),
            "-D", str(images_dir), "-W", str(work_dir), "-o", "lazy-pages.log", "-v4",
            stdin=quiet, stdout=quiet, stderr=quiet, pass_fds=(ps_socket,),
        )  # fmt: skip
        deadline = time.monotonic() + within
        # The socket is the daemon's only sign that it listens.
        while not await asyncio.to_thread(socket_path.exists):
            if daemon.returncode is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    daemon.kill()
                code = await daemon.wait()
                log = work_dir / "lazy-pages.log"
                text = await asyncio.to_thread(log.read_text, errors="replace") if log.exists() else ""
                excerpt = " | ".join(log_excerpt(text)) or "no log"
                raise CriuError("lazy-pages", code, f"the daemon did not listen: {excerpt}")
            await asyncio.sleep(0.002)
        return daemon

    def _restore_env(self) -> dict[str, str | None]:
        """The variables the project's CRIU patches read, each set or removed: the settings decide, not
        what the agent's own environment holds."""
        return {
            RESTORE_HUGE_PAGES_ENV: "1" if self.restore_huge_pages else None,
            RESTORE_READERS_ENV: str(self.restore_readers),
        }


def _environment(changes: Mapping[str, str | None]) -> dict[str, str]:
    merged = {**os.environ, **{k: v for k, v in changes.items() if v is not None}}
    for name in (k for k, v in changes.items() if v is None):
        merged.pop(name, None)
    return merged


def _fresh_lazy_socket(work_dir: Path, socket_path: Path) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)


def _make_dirs(*dirs: Path) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
