"""The agent's restore as the benchmarks vary it: settings the agent does not have, measured against its own
way (BENCHMARKS.md).

- ``overlap_page_check``: the memory pages are checked while CRIU restores them, into a tree held stopped
  (CRIU's --leave-stopped) until they passed. For decoupled artifacts on the H200 it was slower than
  checking them first (at full parallel read speed) and letting CRIU read them from the page cache; for a
  plain 8g artifact on an H100 it gained 1.0-1.2 s of 16 s (BENCHMARKS.md, "Past the disk"). The agent
  checks first.
- ``weights_check_early`` off: at idle I/O priority the weights check starts after the check of the process
  images rather than with it; on the H200 (mq-deadline) no faster: 8g 6.31 vs 5.84/6.34 s, 1g 4.65 vs
  4.07/4.12 s.
- ``weights_check_parallel``: threads of the weights check beside CRIU.
- ``lazy_pages``: CRIU restores the tree with ``--lazy-pages``: the process's private memory is left
  unpopulated and filled by a ``criu lazy-pages`` daemon from the images, on the process's faults first and
  in the background for the rest, while the CUDA restore runs. ``"before_signal"`` waits for the daemon
  to have moved every page before the worker is told to go on; ``"after_signal"`` tells it at once and
  waits after (a daemon that dies while pages are missing leaves them zero-filled, so the agent must
  stop the worker then: the measure of what waiting costs).

``VariantExecutor`` is the agent's Executor with these as attributes; its runtime must be a
``StoppedRestores`` (``StoppableProcessRuntime``, or ``benchmarks.gpu.isolated.IsolatedRuntime``) for the
overlap to happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.errors import ArtifactRefused
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.restore import RestoreRun
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import Workload
from dynamo_snapshot.artifact import ArtifactError
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.cuda import process_tree
from dynamo_snapshot.fileio import HASH_PARALLEL, TreeStats

__all__ = [
    "StoppableProcessRuntime",
    "StoppedRestores",
    "VariantExecutor",
    "VariantRestoreRun",
    "agent_config",
]


def agent_config(**settings: Any) -> AgentConfig:
    """The agent's settings for a benchmark's executor: ``settings`` by name, the rest the defaults."""
    settings.setdefault("node_name", os.uname().nodename)
    return AgentConfig.model_validate(settings)


@runtime_checkable
class StoppedRestores(Protocol):
    async def restore_stopped(self, key: str, images_dir: Path, source_control_dir: str | None) -> Workload:
        """Restore as ``restore`` does, with every process of the tree left stopped."""
        ...

    async def resume(self, workload: Workload) -> None:
        """Let a tree restored stopped run."""
        ...


async def continue_tree(root: int) -> None:
    pids = await asyncio.to_thread(process_tree, root)
    for pid in pids or [root]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class _LeaveStopped(Criu):
    """CRIU whose restores leave the tree stopped."""

    async def restore(self, images_dir: Path, **kwargs: Any) -> Any:
        return await super().restore(images_dir, **{**kwargs, "leave_stopped": True})


class LazyPagesCriu(Criu):
    """CRIU for one lazy restore: it starts a ``criu lazy-pages`` daemon on the images (its socket and log
    in the restore's work dir, ``work``) and restores with ``--lazy-pages``."""

    daemon: asyncio.subprocess.Process | None = None
    work = Path()

    async def restore(self, images_dir: Path, **kwargs: Any) -> Any:
        work = self.work = Path(kwargs.get("log_dir") or images_dir)
        socket = work / "lazy-pages.socket"
        await asyncio.to_thread(_fresh_socket_dir, work, socket)
        quiet = asyncio.subprocess.DEVNULL
        daemon = await asyncio.create_subprocess_exec(
            str(self.binary), "lazy-pages", "-D", str(images_dir), "-W", str(work),
            "-o", "lazy-pages.log", "-v4", stdin=quiet, stdout=quiet, stderr=quiet,
        )  # fmt: skip
        self.daemon = daemon
        while not os.path.exists(socket):  # noqa: ASYNC240 - a tmpfs/control dir stat; the daemon has no other sign
            if daemon.returncode is not None:
                raise RuntimeError(f"criu lazy-pages exited with {daemon.returncode} before listening")
            await asyncio.sleep(0.002)
        extra = (*kwargs.pop("extra_args", ()), "--lazy-pages")
        try:
            return await super().restore(images_dir, **kwargs, extra_args=extra)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
            await daemon.wait()
            raise


LAZY_PAGES_WITHIN = 60.0


def _fresh_socket_dir(work: Path, socket: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"


async def wait_lazy_pages(daemon: asyncio.subprocess.Process, log: Path) -> None:
    """The daemon's end: every page moved, or the restore refused (also when it takes longer than
    LAZY_PAGES_WITHIN)."""
    try:
        await asyncio.wait_for(daemon.wait(), LAZY_PAGES_WITHIN)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
        await daemon.wait()
    if daemon.returncode != 0:
        tail = await asyncio.to_thread(_tail, log)
        raise ArtifactRefused(f"criu lazy-pages exited with {daemon.returncode}: {tail}")


class StoppableProcessRuntime(ProcessRuntime):
    """The agent's host-process runtime, able to restore a tree stopped."""

    async def restore_stopped(self, key: str, images_dir: Path, source_control_dir: str | None) -> Workload:
        # The same runtime state (statefiles under the control root), over a CRIU that leaves it stopped.
        stopped = _LeaveStopped(self.criu.binary, kept_logs=self.criu.kept_logs)
        return await ProcessRuntime(self.control_root, stopped).restore(key, images_dir, source_control_dir)

    async def resume(self, workload: Workload) -> None:
        await continue_tree(workload.pid)


def _is_pages(rel: str) -> bool:
    # CRIU's memory contents (pages-N.img); the other images describe the tree it rebuilds.
    name = rel.rsplit("/", 1)[-1]
    return name.startswith("pages-") and name.endswith(".img")


class VariantRestoreRun(RestoreRun):
    """The agent's restore, with the variants of the VariantExecutor it runs on."""

    node: VariantExecutor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weights_check_parallel = self.node.weights_check_parallel or HASH_PARALLEL
        self.pages: list[str] = []  # pages images checked while CRIU restores them
        self.pages_check: asyncio.Task[TreeStats] | None = None
        self._verifying = False
        self.lazy: LazyPagesCriu | None = None  # the CRIU of a lazy restore, until its daemon is done

    async def verify(self, undo: contextlib.AsyncExitStack) -> None:
        self._verifying = True
        try:
            await super().verify(undo)
        finally:
            self._verifying = False

    def start_weights_check(self, undo: contextlib.AsyncExitStack) -> None:
        if self._verifying and not self.node.weights_check_early:
            return  # run() starts it once the process images passed
        super().start_weights_check(undo)

    async def verify_process_images(self) -> None:
        files = self.process_files()
        if self.node.overlap_page_check and isinstance(self.node.runtime, StoppedRestores):
            self.pages = [f for f in files if _is_pages(f)]
        await self.verify_files([f for f in files if f not in self.pages])

    async def restore_process(self, undo: contextlib.AsyncExitStack) -> Workload:
        if self.pages:
            self.pages_check = asyncio.create_task(
                self.artifact.averify(files=self.pages, verified=self.node.verified)
            )
            undo.push_async_callback(_cancel, self.pages_check)
        return await super().restore_process(undo)

    async def criu_restore(self, images: Path, source_control_dir: str | None) -> Workload:
        runtime = self.node.runtime
        if self.node.lazy_pages and isinstance(runtime, ProcessRuntime):
            lazy = LazyPagesCriu(self.node.criu.binary, kept_logs=self.node.criu.kept_logs)
            workload = await ProcessRuntime(runtime.control_root, lazy).restore(
                self.key, images, source_control_dir
            )
            self.lazy = lazy
            return workload
        if self.pages_check is None or not isinstance(runtime, StoppedRestores):
            return await super().criu_restore(images, source_control_dir)
        return await runtime.restore_stopped(self.key, images, source_control_dir)

    async def lazy_pages_moved(self) -> None:
        if self.lazy is not None and self.lazy.daemon is not None:
            with self.timings.phase("restore", "lazy_pages_wait"):
                await wait_lazy_pages(self.lazy.daemon, self.lazy.work / "lazy-pages.log")
            self.lazy = None

    async def hand_over(self, workload: Workload, undo: contextlib.AsyncExitStack) -> None:
        if self.node.lazy_pages == "before_signal":
            await self.lazy_pages_moved()
        await super().hand_over(workload, undo)
        await self.lazy_pages_moved()

    async def resume_process(self, workload: Workload) -> None:
        """The tree runs once its pages passed."""
        runtime = self.node.runtime
        if self.pages_check is not None and isinstance(runtime, StoppedRestores):
            with self.timings.phase("restore", "pages_wait"):
                try:
                    await self.pages_check
                except (ArtifactError, ValueError) as e:
                    raise ArtifactRefused(f"artifact {self.artifact.key} refused: {e}") from None
            await runtime.resume(workload)
        await super().resume_process(workload)
        if self.pages_check is not None:
            self.verified_bytes += self.pages_check.result().bytes


class VariantExecutor(Executor):
    restore_run = VariantRestoreRun

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_page_check = False
        self.weights_check_early = True
        self.weights_check_parallel: int | None = None
        self.lazy_pages: str | None = None  # "before_signal" or "after_signal"

    # The agent's own settings, as the variants name them.
    @property
    def prefetch_node_files(self) -> bool:
        return self.config.checkpoint.prefetch_node_files

    @prefetch_node_files.setter
    def prefetch_node_files(self, on: bool) -> None:
        self.config.checkpoint.prefetch_node_files = on

    @property
    def restore_huge_pages(self) -> bool:
        return self.criu.restore_huge_pages

    @restore_huge_pages.setter
    def restore_huge_pages(self, on: bool) -> None:
        self.criu.restore_huge_pages = on

    @property
    def restore_readers(self) -> int:
        return self.criu.restore_readers

    @restore_readers.setter
    def restore_readers(self, n: int) -> None:
        self.criu.restore_readers = n

    @property
    def weights_check_idle_io(self) -> bool:
        return self.config.restore.weights_check_idle_io

    @weights_check_idle_io.setter
    def weights_check_idle_io(self, on: bool) -> None:
        self.config.restore.weights_check_idle_io = on


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
