"""The handshake hook that takes KV caches and weights out of the checkpoint and puts them back.

Before ready-for-snapshot is written: each registered WeightRegion is saved to its file (skipped when
the file holds these bytes already), the weights and the KV caches are released, so the CUDA checkpoint
has almost nothing to copy, and the control directory's weights.json names the files and the bytes
released per GPU. After the
agent restored the process (restore-complete), or dumped it and let it run on (snapshot-complete), the
KV caches are mapped again and the weights read back from their files. When the agent is still
checking the weights it carried (restore-complete says so), they are read through the page cache the
agent's check fills, and the hook returns, so the worker serves, only once the agent wrote
weights-verified. When the weights are still arriving from an object store (restore-complete says so
too), each read waits until the agent says its bytes are in and checked (weights.arrival).

    handshake = SnapshotHandshake.from_env()
    handshake.register_kv_cache(kv)
    handshake.register_weights(weights, "/models/cache/llama-70b.dsw")
    info = handshake.checkpoint_and_wait()

Works through SnapshotHandshake.add_hook; any object with the same two methods can be a hook.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dynamo_snapshot.workload.weights import (
    DEFAULT_BLOCK_BYTES,
    ENCODING_SPLIT_NIBBLE,
    ENCODINGS,
    LoadResult,
    SaveResult,
    WeightsArrival,
    wait_for_weights_verified,
    weights_arriving,
    weights_check_pending,
    write_weights_manifest,
)

if TYPE_CHECKING:
    from dynamo_snapshot.workload.handshake import RestoreInfo, SnapshotHandshake

__all__ = ["GpuOffload", "OffloadReport", "ReleasableCache", "SavableWeights"]

log = logging.getLogger(__name__)


class ReleasableCache(Protocol):
    """What GpuOffload needs of a KV cache (KvCache has it)."""

    @property
    def device(self) -> int: ...

    def release_for_checkpoint(self) -> int: ...

    def reacquire_after_restore(self, *, zero: bool = False) -> int: ...


class SavableWeights(Protocol):
    """What GpuOffload needs of a weight region (WeightRegion has it)."""

    device: int

    def save(
        self, path: Path | str, *, chunk_bytes: int = ..., threads: int = ..., encoding: str = ...
    ) -> SaveResult: ...

    def release(self) -> int: ...

    def load(
        self,
        path: Path | str,
        *,
        threads: int = ...,
        block: int = ...,
        buffers: int = ...,
        verify: bool = ...,
        direct: bool | None = ...,
        arriving: WeightsArrival | None = ...,
    ) -> LoadResult: ...


@dataclass
class OffloadReport:
    """What the last checkpoint and resume did, with seconds per step (for logs and benchmarks)."""

    saved: list[SaveResult] = field(default_factory=list)
    released_bytes: int = 0
    checkpoint_seconds: float = 0.0
    reacquired_bytes: int = 0
    loaded: list[LoadResult] = field(default_factory=list)
    resume_seconds: float = 0.0
    # Waiting, after the loads, for the agent's verdict on the weights it was still checking.
    weights_check_wait_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "saved": [s.to_dict() for s in self.saved],
            "released_bytes": self.released_bytes,
            "checkpoint_seconds": round(self.checkpoint_seconds, 4),
            "reacquired_bytes": self.reacquired_bytes,
            "loaded": [r.to_dict() for r in self.loaded],
            "resume_seconds": round(self.resume_seconds, 4),
            "weights_check_wait_seconds": round(self.weights_check_wait_seconds, 4),
        }


class GpuOffload:
    """A SnapshotHandshake hook: KV caches released and reacquired, weights saved, released, loaded."""

    def __init__(
        self,
        *,
        load_threads: int = 16,
        load_block: int = DEFAULT_BLOCK_BYTES,
        load_buffers: int = 8,
        verify_load: bool = False,
        zero_kv: bool = False,
        weights_check_timeout: float | None = None,
        weights_encoding: str = ENCODING_SPLIT_NIBBLE,
    ) -> None:
        if weights_encoding not in ENCODINGS:
            # Here, not only in save(): a typo would otherwise surface at the first checkpoint.
            raise ValueError(f"weights_encoding must be one of {ENCODINGS}, got {weights_encoding!r}")
        self.load_threads = load_threads
        self.load_block = load_block
        self.load_buffers = load_buffers
        # Off by default: the node agent checks the file against the artifact, and the worker serves
        # only after that check passed (before restore-complete, or weights-verified after it).
        self.verify_load = verify_load
        self.zero_kv = zero_kv
        self.weights_check_timeout = weights_check_timeout
        # How weights files are stored (weights.ENCODINGS): split-nibble reads ~1.33x fewer bytes.
        self.weights_encoding = weights_encoding
        self._kv: list[ReleasableCache] = []
        self._weights: list[tuple[SavableWeights, Path]] = []
        self._released_kv: list[ReleasableCache] = []
        self._released_weights: list[tuple[SavableWeights, Path]] = []
        self.report = OffloadReport()

    def add_kv_cache(self, cache: ReleasableCache) -> None:
        self._kv.append(cache)

    def add_weights(self, weights: SavableWeights, path: Path | str) -> None:
        self._weights.append((weights, Path(path).absolute()))

    @property
    def empty(self) -> bool:
        return not self._kv and not self._weights

    def before_checkpoint(self, handshake: SnapshotHandshake) -> None:
        started = time.monotonic()
        report = OffloadReport()
        for weights, path in self._weights:
            report.saved.append(weights.save(path, encoding=self.weights_encoding))
        released: dict[int, int] = {}
        for weights, path in self._weights:
            n = weights.release()
            released[weights.device] = released.get(weights.device, 0) + n
            self._released_weights.append((weights, path))
        for cache in self._kv:
            n = cache.release_for_checkpoint()
            released[cache.device] = released.get(cache.device, 0) + n
            self._released_kv.append(cache)
        report.released_bytes = sum(released.values())
        # Last, so a failure above leaves no manifest behind; the handshake undoes the releases. The
        # agent carries the files in the artifact and checks a target GPU has room for what comes back.
        write_weights_manifest(
            handshake.control_dir,
            [s.manifest_entry(w.device) for s, (w, _) in zip(report.saved, self._weights, strict=True)],
            released,
            waits_for_weights_check=True,  # on_resume waits for the verdict before the worker serves
            reads_arriving_weights=True,  # and its loads wait for each byte still arriving
        )
        report.checkpoint_seconds = time.monotonic() - started
        self.report = report
        log.info(
            "released %.2f GiB of GPU memory for the checkpoint in %.2f s",
            report.released_bytes / 2**30,
            report.checkpoint_seconds,
        )

    def on_resume(self, handshake: SnapshotHandshake, info: RestoreInfo | None) -> None:
        """Reacquire what before_checkpoint released (also after a failed before_checkpoint)."""
        started = time.monotonic()
        # The agent may still be reading the weights to check them: read them through the page cache
        # too (O_DIRECT would read from the disk what the agent's reads just brought in).
        pending = info is not None and weights_check_pending(info.content)
        # Still arriving from the object store: each read waits for its bytes to be in and checked.
        arriving = (
            WeightsArrival(handshake.control_dir, timeout=self.weights_check_timeout)
            if pending and info is not None and weights_arriving(info.content)
            else None
        )
        # KV first: it is only a mapping, and holding it early keeps its memory from other users.
        while self._released_kv:
            cache = self._released_kv.pop(0)
            self.report.reacquired_bytes += cache.reacquire_after_restore(zero=self.zero_kv)
        while self._released_weights:
            weights, path = self._released_weights[0]
            self.report.loaded.append(
                weights.load(
                    path,
                    threads=self.load_threads,
                    block=self.load_block,
                    buffers=self.load_buffers,
                    verify=self.verify_load,
                    direct=False if pending else None,
                    arriving=arriving,
                )
            )
            self._released_weights.pop(0)
        if pending:
            self.report.weights_check_wait_seconds = wait_for_weights_verified(
                handshake.control_dir, timeout=self.weights_check_timeout
            )
        self.report.resume_seconds = time.monotonic() - started
        loads = ", ".join(f"{r.bytes / 2**30:.2f} GiB at {r.gbps:.1f} GB/s" for r in self.report.loaded)
        log.info(
            "restored GPU memory (KV %.2f GiB, weights %s) in %.2f s",
            self.report.reacquired_bytes / 2**30,
            loads or "none",
            self.report.resume_seconds,
        )
