"""A KV cache whose GPU memory is given back before a checkpoint and taken again after the restore.

The cache is one VmmRegion; the engine carves its tensors out of it with allocate() (per-layer K and V
blocks, block tables, ...). Because reacquire maps the new physical memory at the same virtual
addresses, every tensor handed out stays valid, and CUDA graphs captured over them replay correctly
after the restore. Only the contents are lost, which is what a KV cache of a freshly restored
worker should contain anyway (zero=True on reacquire when the engine relies on zeroed memory).

    kv = KvCache(0.9)                                   # 90% of the free GPU memory
    k = kv.allocate("k", (layers, blocks, block_size, heads, dim), torch.bfloat16)
    ...capture CUDA graphs...
    kv.release_for_checkpoint()                         # nothing of it is checkpointed
    ...restore...
    kv.reacquire_after_restore()
"""

from __future__ import annotations

import math
from typing import Any

from dynamo_snapshot.workload.gpu_memory import (
    KIND_KV,
    RegionPool,
    VmmRegion,
    _import_torch,
    allocation_granularity,
    device_memory_info,
    round_up,
)

__all__ = ["DEFAULT_TENSOR_ALIGNMENT", "KvCache"]

# Every tensor starts on this boundary: the widest vector loads kernels use (and cuBLAS's preference).
DEFAULT_TENSOR_ALIGNMENT = 256


def _size_in_bytes(size: int | float, device: int, headroom_bytes: int, driver: Any | None) -> int:
    if isinstance(size, bool) or not isinstance(size, int | float):
        raise TypeError(f"size must be bytes (int) or a fraction of free memory (float), got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"size must be > 0 bytes, got {size}")
        return size
    if not 0.0 < size <= 1.0:
        raise ValueError(f"a fraction of free memory must be in (0, 1], got {size}")
    free, _ = device_memory_info(device, driver=driver)
    gran = allocation_granularity(device, driver=driver)
    # Rounded down: the region rounds up to the granularity and must still fit in what is free.
    nbytes = int((free - headroom_bytes) * size) // gran * gran
    if nbytes <= 0:
        raise ValueError(
            f"{size:.0%} of the free memory ({free} bytes, {headroom_bytes} kept back) is less than "
            f"one allocation unit ({gran} bytes)"
        )
    return nbytes


class KvCache:
    """KV cache memory of `size` bytes (int) or `size` of the device's free memory (float in (0, 1]),
    less `headroom_bytes` kept free for activations and workspaces."""

    def __init__(
        self,
        size: int | float,
        *,
        device: int = 0,
        headroom_bytes: int = 0,
        kind: str = KIND_KV,
        pool: RegionPool | None = None,
        driver: Any | None = None,
    ) -> None:
        nbytes = _size_in_bytes(size, device, headroom_bytes, driver)
        self.region = VmmRegion(nbytes, device, kind=kind, pool=pool, driver=driver)
        self._next = 0
        self._tensors: dict[str, Any] = {}

    @property
    def size(self) -> int:
        return self.region.size

    @property
    def device(self) -> int:
        return self.region.device

    @property
    def used_bytes(self) -> int:
        return self._next

    @property
    def free_bytes(self) -> int:
        return self.region.size - self._next

    @property
    def released(self) -> bool:
        return not self.region.mapped

    @property
    def tensors(self) -> dict[str, Any]:
        """The tensors allocate() handed out, by name."""
        return dict(self._tensors)

    def allocate(
        self,
        name: str,
        shape: tuple[int, ...] | list[int],
        dtype: Any,
        *,
        alignment: int = DEFAULT_TENSOR_ALIGNMENT,
    ) -> Any:
        """A new tensor of `shape` and `dtype` in the cache, `alignment`-aligned, after the last one."""
        if name in self._tensors:
            raise ValueError(f"a KV tensor named {name!r} exists already")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        torch = _import_torch()
        itemsize = int(torch.empty((), dtype=dtype).element_size())
        nbytes = math.prod(int(s) for s in shape) * itemsize
        offset = round_up(self._next, max(alignment, itemsize))
        if offset + nbytes > self.region.size:
            raise ValueError(
                f"{name}: {nbytes} bytes do not fit in the KV cache ({self.free_bytes} of {self.size} free)"
            )
        view = self.region.as_tensor(dtype, tuple(shape), offset)
        self._next = offset + nbytes
        self._tensors[name] = view
        return view

    def view(self, shape: tuple[int, ...] | list[int], dtype: Any, offset: int = 0) -> Any:
        """A tensor over any part of the cache, outside allocate()'s bookkeeping."""
        return self.region.as_tensor(dtype, tuple(shape), offset)

    def release_for_checkpoint(self) -> int:
        """Give the GPU memory back (waiting for running work first); bytes released. Nothing may touch
        the cache's tensors until reacquire_after_restore()."""
        return self.region.release()

    def reacquire_after_restore(self, *, zero: bool = False) -> int:
        """Map new memory at the same addresses; bytes mapped. Contents are undefined unless `zero`."""
        mapped = self.region.reacquire()
        if zero:
            self.region.zero()
        return mapped

    def free(self) -> None:
        """Give everything back, address range included; drop the tensors first."""
        self._tensors.clear()
        self.region.free()
