"""The CUDA state of a worker's processes: locked and checkpointed before CRIU dumps them, restored (onto
remapped GPUs) and unlocked once CRIU has brought them back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.cuda import CudaCheckpointer, CudaError, ProcessState, process_tree

log = logging.getLogger(__name__)

__all__ = ["checkpointed_pids", "resume_cuda", "suspend_cuda"]


async def suspend_cuda(cuda: CudaCheckpointer | None, pids: list[int], lock_timeout_ms: int) -> None:
    """Lock every process, then checkpoint them all at once (each copies its own GPU memory out: a
    tensor-parallel worker's ranks need not wait for one another); on a CUDA error all are resumed and
    AgentError raised."""
    if not pids or cuda is None:
        return
    try:
        for pid in pids:  # lock all first: no process may touch the GPU while another is checkpointed
            await asyncio.to_thread(cuda.lock, pid, lock_timeout_ms)
        await _each(pids, lambda pid: asyncio.to_thread(cuda.checkpoint, pid))
    except CudaError as e:
        await resume_cuda(cuda, pids, {}, best_effort=True)
        raise AgentError(f"CUDA checkpoint failed: {e}") from None


async def resume_cuda(
    cuda: CudaCheckpointer | None, pids: list[int], remap: dict[str, str], *, best_effort: bool = False
) -> None:
    """Restore (with ``remap``: old GPU UUID -> new) and unlock each process, whichever state it is in,
    all at once. ``best_effort`` logs a failure instead of raising AgentError."""
    if not pids or cuda is None:
        return

    def resume(pid: int) -> None:
        try:
            state = cuda.state(pid)
            if state is ProcessState.CHECKPOINTED:
                cuda.restore(pid, remap or None)
                state = cuda.state(pid)
            if state is ProcessState.LOCKED:
                cuda.unlock(pid)
        except CudaError as e:
            if not best_effort:
                raise AgentError(f"CUDA restore of pid {pid} failed: {e}") from None
            log.warning("could not resume CUDA", extra={"pid": pid, "error": str(e)})

    await _each(pids, lambda pid: asyncio.to_thread(resume, pid))


async def _each(pids: list[int], call: Callable[[int], Awaitable[None]]) -> None:
    """``call`` for every pid at once; the first error is raised once all have ended (none is left
    running behind a resume)."""
    results = await asyncio.gather(*(call(pid) for pid in pids), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def checkpointed_pids(cuda: CudaCheckpointer | None, root_pid: int) -> list[int]:
    """Processes of the restored tree whose CUDA state waits to be restored (they hold no GPU fds now, so
    the driver's own state is the only reliable sign)."""
    if cuda is None:
        return []

    def scan() -> list[int]:
        found = []
        for pid in process_tree(root_pid):
            with contextlib.suppress(CudaError):
                if cuda.state(pid) is ProcessState.CHECKPOINTED:
                    found.append(pid)
        return found

    return await asyncio.to_thread(scan)
