"""Moving bytes between a weights region on the GPU and host memory: the TransferEngine protocol, page-
aligned host buffers, and the torch engine (pinned buffers, one CUDA stream, split-nibble records made and
expanded on the GPU)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Callable
from typing import Any, Protocol

from dynamo_snapshot.fileio import ALIGN
from dynamo_snapshot.workload.gpu_memory import (
    VmmRegion,
    _import_torch,
    register_host_memory,
    unregister_host_memory,
)
from dynamo_snapshot.workload.weights.codec import (
    LOOKUP_PIECE,
    decode_coded_on,
    encode_coded_on,
    nibble_table_on,
)
from dynamo_snapshot.workload.weights.format import coded_record_bytes

__all__ = ["EngineFactory", "HostBuffer", "MmapBuffer", "TorchEngine", "TransferEngine"]


class HostBuffer(Protocol):
    """Host memory a TransferEngine copies from and to; view() is writable and 1-D of bytes."""

    @property
    def nbytes(self) -> int: ...

    @property
    def aligned(self) -> bool:
        """Its address is a multiple of ALIGN (O_DIRECT may read into it)."""
        ...

    def view(self) -> memoryview: ...


class TransferEngine(Protocol):
    """Copies between one region and host buffers it allocates. Called from one thread only."""

    def host_buffer(self, nbytes: int) -> HostBuffer: ...

    def download(self, offset: int, buf: HostBuffer, nbytes: int) -> None:
        """region[offset:offset+nbytes] -> buf[:nbytes]; returns once the bytes are there."""
        ...

    def upload(self, buf: HostBuffer, nbytes: int, offset: int) -> None:
        """buf[:nbytes] -> region[offset:]; may return before the copy is done."""
        ...

    def count_escapes(self, offset: int, nbytes: int) -> int:
        """The escapes a split-nibble record of region[offset:+nbytes] has (nbytes a multiple of 4)."""
        ...

    def download_coded(self, offset: int, buf: HostBuffer, nbytes: int) -> int:
        """region[offset:+nbytes] as a split-nibble record into buf (which holds the longest one,
        coded_record_bytes(nbytes, escape_limit(nbytes))); its length. Only for a chunk whose escapes
        are within escape_limit."""
        ...

    def upload_coded(self, buf: HostBuffer, nbytes: int, offset: int, escapes: int) -> None:
        """Like upload, from the split-nibble record of region[offset:+nbytes] that buf holds."""
        ...

    def wait_upload(self, buf: HostBuffer) -> None:
        """Until the last upload from `buf` is done (then `buf` may be overwritten)."""
        ...

    def finish(self) -> None:
        """Until every upload is done."""
        ...

    def close(self) -> None:
        """finish(), then free the host buffers."""
        ...


EngineFactory = Callable[[VmmRegion], TransferEngine]


class MmapBuffer:
    """Anonymous, page-aligned host memory (mmap), viewed as bytes."""

    def __init__(self, nbytes: int) -> None:
        self._mmap = mmap.mmap(-1, max(nbytes, 1))
        anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping does; the export must not linger
        self._view = memoryview(self._mmap)[:nbytes]
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def aligned(self) -> bool:
        return self.address % ALIGN == 0

    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        self._view.release()
        # A slice still held somewhere (a traceback) keeps the mapping; the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._mmap.close()


class _PinnedBuffer(MmapBuffer):
    """An MmapBuffer registered with CUDA (page-locked) and wrapped as a CPU tensor for copy_()."""

    def __init__(self, torch: Any, nbytes: int, device: int, driver: Any) -> None:
        super().__init__(nbytes)
        self._device = device
        self._driver = driver
        register_host_memory(self.address, len(self._mmap), device, driver=driver)
        self._registered = True
        # frombuffer shares the memory (no copy, no NumPy).
        self.tensor: Any = torch.frombuffer(self._mmap, dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        self.tensor = None
        if self._registered:
            self._registered = False
            unregister_host_memory(self.address, self._device, driver=self._driver)
        super().close()


class TorchEngine:
    """Copies on a dedicated CUDA stream, between the region and page-locked host buffers (so the
    host-to-device copies are asynchronous DMA)."""

    def __init__(self, region: VmmRegion) -> None:
        torch = _import_torch()
        self._torch = torch
        self._region = region
        self._device = torch.device("cuda", region.device)
        with torch.cuda.device(self._device):
            # Work queued earlier on other streams (pack's copies, the model) must not race a download.
            torch.cuda.synchronize(self._device)
            self._stream = torch.cuda.Stream(device=self._device)
        self._flat: Any = region.as_tensor(torch.uint8, (region.size,))
        self._events: dict[int, Any] = {}
        self._buffers: list[_PinnedBuffer] = []
        # Device memory the planes pass through; one suffices, as every copy runs on self._stream.
        # A region of its own (not torch's cache), so closing gives it back to the driver.
        self._scratch: VmmRegion | None = None
        self._scratch_flat: Any = None
        self._coded = False

    def _scratch_tensor(self, nbytes: int) -> Any:
        if self._scratch is None or self._scratch.size < nbytes:
            self._free_scratch()
            self._scratch = VmmRegion(nbytes, self._region.device, driver=self._region.driver)
            self._scratch_flat = self._scratch.as_tensor(self._torch.uint8, (self._scratch.size,))
        return self._scratch_flat[:nbytes]

    def _free_scratch(self) -> None:
        self._scratch_flat = None
        if self._scratch is not None:
            self._stream.synchronize()  # copies queued on it may still use the old scratch
            self._scratch.free()
            self._scratch = None

    def _pinned(self, buf: HostBuffer) -> _PinnedBuffer:
        if not isinstance(buf, _PinnedBuffer):
            raise TypeError(f"not a buffer of this engine: {buf!r}")
        return buf

    def host_buffer(self, nbytes: int) -> HostBuffer:
        buf = _PinnedBuffer(self._torch, nbytes, self._region.device, self._region.driver)
        self._buffers.append(buf)
        return buf

    def download(self, offset: int, buf: HostBuffer, nbytes: int) -> None:
        torch = self._torch
        src = self._flat[offset : offset + nbytes]
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._pinned(buf).tensor[:nbytes].copy_(src, non_blocking=True)
        self._stream.synchronize()

    def upload(self, buf: HostBuffer, nbytes: int, offset: int) -> None:
        torch = self._torch
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._flat[offset : offset + nbytes].copy_(self._pinned(buf).tensor[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[id(buf)] = event

    # Split-nibble records are made and expanded here, on the GPU, in the scratch:
    # [planes: even | odd, n][record, n][codes, n/2][lookup indices, int32 x LOOKUP_PIECE]
    def _coding_scratch(self, nbytes: int) -> tuple[Any, Any, Any, Any]:
        sc = self._scratch_tensor(2 * nbytes + nbytes // 2 + 4 * LOOKUP_PIECE)
        rec_end = 2 * nbytes
        codes_end = rec_end + nbytes // 2
        return sc[:nbytes], sc[nbytes:rec_end], sc[rec_end:codes_end], sc[codes_end:].view(self._torch.int32)

    def _split(self, offset: int, nbytes: int, planes: Any) -> None:
        half = nbytes // 2
        planes.view(2, half).copy_(self._flat[offset : offset + nbytes].view(half, 2).t())

    def count_escapes(self, offset: int, nbytes: int) -> int:
        torch = self._torch
        self._coded = True
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, _, _, _ = self._coding_scratch(nbytes)
            self._split(offset, nbytes, planes)
            _, escapes = nibble_table_on(torch, planes[nbytes // 2 :])
            count = int(escapes)
        return count

    def download_coded(self, offset: int, buf: HostBuffer, nbytes: int) -> int:
        torch = self._torch
        self._coded = True
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, rec, codes, idx = self._coding_scratch(nbytes)
            self._split(offset, nbytes, planes)
            length = encode_coded_on(torch, planes, rec, codes, idx)
            self._pinned(buf).tensor[:length].copy_(rec[:length], non_blocking=True)
        self._stream.synchronize()
        return length

    def upload_coded(self, buf: HostBuffer, nbytes: int, offset: int, escapes: int) -> None:
        torch = self._torch
        half = nbytes // 2
        length = coded_record_bytes(nbytes, escapes)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            planes, rec, codes, idx = self._coding_scratch(nbytes)
            rec[:length].copy_(self._pinned(buf).tensor[:length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)  # the pinned buffer is free from here on
            odd = planes[half:]
            decode_coded_on(torch, rec, nbytes, escapes, odd, codes, idx)
            dst = self._flat[offset : offset + nbytes].view(half, 2)
            dst[:, 0].copy_(rec[:half])
            dst[:, 1].copy_(odd)
        self._events[id(buf)] = event

    def wait_upload(self, buf: HostBuffer) -> None:
        event = self._events.pop(id(buf), None)
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        self._stream.synchronize()
        self._events.clear()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            # Unpinned and unmapped now: nothing of them is left to be checkpointed with the process.
            buffers, self._buffers = self._buffers, []
            self._flat = None
            self._free_scratch()
            for buf in buffers:
                buf.close()
            if self._coded:
                # Making records left small temporaries in torch's cache; a save comes right before a
                # checkpoint, which would copy them.
                self._torch.cuda.empty_cache()
