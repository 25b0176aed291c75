"""CRIU's memory-page images on this node: made smaller at checkpoint (zero pages dropped, pages
compressed), and unpacked for CRIU at restore into a staging images directory of the restore's own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dynamo_snapshot.agent.errors import AgentError, ArtifactRefused
from dynamo_snapshot.agent.metrics import PAGES_COMPRESSED_SAVED, ZERO_PAGES_DROPPED
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.agent.timings import Timings
from dynamo_snapshot.artifact import Artifact
from dynamo_snapshot.criu.packed import (
    PackedFormatError,
    PagesPacked,
    StageStats,
    is_packed_pages,
    pack_pages,
    stage_images,
    staged_bytes,
)
from dynamo_snapshot.criu.sparse import PAGE, Damaged, ImageFormatError, SparseStats, drop_zero_pages

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["PagesScratch", "StagedPages", "compress_pages", "drop_zero_pages_of", "in_thread_stoppable"]

# Free space a scratch directory must have beyond the unpacked pages.
_SCRATCH_MARGIN = 64 << 20


async def in_thread_stoppable(work: Callable[[threading.Event], T]) -> T:
    """``work(stop)`` in a thread. Cancelled, it sets ``stop`` and returns only once ``work`` has, so the
    caller's clean-up never races it."""
    stop = threading.Event()
    running = asyncio.ensure_future(asyncio.to_thread(work, stop))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(BaseException):
            await running
        raise


# ------------------------------------------------------------------ checkpoint
async def drop_zero_pages_of(images: Path, advise_huge_pages: bool = False) -> SparseStats | None:
    """criu.sparse.drop_zero_pages in a thread, logged; None (the images as CRIU wrote them) if it cannot
    read them; AgentError if it failed while moving pages, which leaves the dump unusable. Cancelled,
    it stops within a batch of pages and returns only then, so the caller's clean-up (which throws the
    dump away) never races the rewrite. ``advise_huge_pages``: the memory it empties is marked for huge
    pages at restore."""
    try:
        stats = await in_thread_stoppable(
            lambda stop: drop_zero_pages(images, stop, advise_huge_pages=advise_huge_pages)
        )
    except Damaged as e:
        raise AgentError(f"dropping zero pages failed mid-rewrite, the dump is discarded: {e}") from None
    except (OSError, ImageFormatError) as e:
        log.warning("zero pages kept: cannot read the CRIU images", extra={"error": str(e)})
        return None
    if stats.skipped:
        log.warning("zero pages kept for some processes", extra={"processes": stats.skipped})
    if stats.unadvised:
        log.warning("emptied memory not marked for huge pages", extra={"processes": stats.unadvised})
    ZERO_PAGES_DROPPED.inc(stats.bytes_dropped)
    log.info(
        "zero pages dropped from the CRIU images",
        extra={
            "bytes": stats.bytes_dropped,
            "of_bytes": stats.pages_before * PAGE,
            "huge_page_advice": stats.huge_page_advice,
            "seconds": round(stats.seconds, 3),
        },
    )
    return stats


async def compress_pages(images: Path, threads: int) -> PagesPacked:
    """criu.packed.pack_pages in a thread, logged. Cancelled, it stops within a few chunks and returns
    only then (the pages images left whole, each plain or packed)."""
    packed = await in_thread_stoppable(lambda stop: pack_pages(images, threads=threads, stop=stop))
    if packed.failed:
        log.warning("pages images left uncompressed", extra={"files": packed.failed})
    PAGES_COMPRESSED_SAVED.inc(packed.bytes_before - packed.bytes_after)
    log.info(
        "CRIU pages images compressed",
        extra={
            "files": packed.files,
            "bytes": packed.bytes_before,
            "to_bytes": packed.bytes_after,
            "seconds": round(packed.seconds, 3),
        },
    )
    return packed


def has_packed_pages(images: Path) -> bool:
    """Whether a CRIU images directory holds compressed pages (which a restore must unpack)."""
    return any(is_packed_pages(p.name) for p in images.iterdir())


# ------------------------------------------------------------------ restore
class StagedPages:
    """One restore's pages unpacked for CRIU: the task unpacking them, then the directory it made."""

    def __init__(self, task: asyncio.Task[Path]) -> None:
        self._task = task

    async def wait(self) -> Path:
        return await self._task

    async def discard(self) -> None:
        """Stop the unpacking, or remove what it made; safe to call again."""
        if not self._task.done():
            self._task.cancel()  # PagesScratch.stage removes what it wrote before it returns
        with contextlib.suppress(BaseException):
            staged = await self._task
            await asyncio.to_thread(shutil.rmtree, staged, True)


@dataclass
class PagesScratch:
    """Where restores unpack compressed pages: under ``base`` (a tmpfs, so CRIU reads them at memory
    speed), else, where that is unusable or too small, under a fallback beside the workload's control
    dir. ``cleaned``: the bases already rid of dead agents' staging (shared by this node's restores)."""

    base: Path | None
    threads: int
    cleaned: set[Path] = field(default_factory=set)

    def start(
        self, artifact: Artifact, fallback: Callable[[], Path], key: str, timings: Timings
    ) -> StagedPages | None:
        """Unpack the artifact's compressed pages for CRIU, in a task; None where it has none. ``fallback``
        gives the other place, asked only when there are pages to unpack."""
        criu_files = [
            f.path.removeprefix("criu/") for f in artifact.manifest.files if f.path.startswith("criu/")
        ]
        if not any(is_packed_pages(f) for f in criu_files):
            return None

        async def stage() -> Path:
            started = time.monotonic()
            staged = await self.stage(artifact.path / "criu", criu_files, artifact.key, fallback, key)
            timings.overlapped["unpack_pages"] = round(time.monotonic() - started, 4)
            return staged

        return StagedPages(asyncio.create_task(stage()))

    async def stage(
        self, images: Path, files: list[str], artifact_key: str, fallback: Callable[[], Path], key: str
    ) -> Path:
        """A new images directory for CRIU: the artifact's compressed pages unpacked, its other images
        copied. Only the files the artifact seals (``files``); they are being checked meanwhile, and CRIU
        runs on the directory only once that check passed."""
        try:
            need = await asyncio.to_thread(staged_bytes, images, files)
        except (PackedFormatError, OSError) as e:
            raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
        bases = [b for b in (self.base, fallback()) if b is not None]
        problems = []
        for base in bases:
            try:
                staged, stats = await self._unpack_into(base, key, need, images, files)
            except PackedFormatError as e:
                raise ArtifactRefused(f"artifact {artifact_key} refused: {e}") from None
            except OSError as e:  # no room, or not writable: the next place
                problems.append(f"{base}: {e}")
                log.warning("cannot unpack the CRIU pages here", extra={"dir": str(base), "error": str(e)})
                continue
            log.info(
                "CRIU pages unpacked",
                extra={
                    "dir": str(staged),
                    "bytes": stats.bytes,
                    "packed_bytes": stats.packed_bytes,
                    "seconds": round(stats.seconds, 3),
                },
            )
            return staged
        raise AgentError("cannot unpack the CRIU pages: " + "; ".join(problems))

    async def _unpack_into(
        self, base: Path, key: str, need: int, images: Path, files: list[str]
    ) -> tuple[Path, StageStats]:
        """Unpack into a fresh directory under ``base``; whatever fails leaves nothing there."""
        staged = await asyncio.to_thread(self._scratch_dir, base, key, need)
        try:
            stats = await in_thread_stoppable(
                lambda stop: stage_images(images, files, staged, threads=self.threads, stop=stop)
            )
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, staged, True)
            raise
        return staged, stats

    def _scratch_dir(self, base: Path, key: str, need: int) -> Path:
        """A fresh directory under ``base`` with room for ``need`` bytes more, else ``OSError``."""
        base.mkdir(parents=True, exist_ok=True)
        if base not in self.cleaned:
            remove_abandoned(base)
            self.cleaned.add(base)
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        if free < need + _SCRATCH_MARGIN:
            raise OSError(f"{free >> 20} MiB free, the pages need {need >> 20} MiB")
        staged = base / f"{os.getpid()}-{key}-{secrets.token_hex(4)}"
        staged.mkdir(mode=0o700)
        return staged


def remove_abandoned(base: Path) -> None:
    """Staging images directories under ``base`` whose agent process is gone (killed mid-restore)."""
    for entry in base.iterdir():
        owner = entry.name.split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not pid_running(int(owner)):
            shutil.rmtree(entry, ignore_errors=True)
