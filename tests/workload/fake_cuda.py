"""A pure-Python stand-in for the parts of cuda.bindings.driver that gpu_memory calls, and a transfer
engine over its "device memory", for the logic tests of VmmRegion, KvCache and WeightRegion.

Only for logic (state machines, call order, rollback, file format): the real driver is exercised by
tests/gpu/vmm_scenarios.py on the H200. It follows cuda-bindings' conventions: every call returns a
tuple whose first item is a CUresult enum member, values after it, and None for them on failure.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

from dynamo_snapshot.workload.gpu_memory import VmmRegion
from dynamo_snapshot.workload.weights import HostBuffer, MmapBuffer, count_escapes, decode_coded, encode_coded

GARBAGE = 0xA5  # what "undefined contents" of fresh physical memory look like here


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_SUPPORTED = 801


OK = CUresult.CUDA_SUCCESS


class _Handle(int):
    pass


class _Ptr(int):
    pass


class _Ctx(int):
    pass


@dataclass
class _Location:
    type: Any = 0
    id: int = 0


@dataclass
class CUmemAllocationProp:
    type: Any = 0
    location: _Location = field(default_factory=_Location)
    requestedHandleTypes: Any = 0


@dataclass
class CUmemAccessDesc:
    location: _Location = field(default_factory=_Location)
    flags: Any = 0


class FakeDriver:
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_NONE=0)
    CUmemAllocationGranularity_flags = SimpleNamespace(
        CU_MEM_ALLOC_GRANULARITY_MINIMUM=0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1
    )
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, *, granularity: int = 64 << 10, total: int = 1 << 30, devices: int = 2) -> None:
        self.granularity = granularity
        self.total = total
        self.devices = devices
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, CUresult] = {}  # op -> result of its next call
        self._tls = threading.local()
        self._next_va = 0x7F00_0000_0000
        self._next_handle = 1
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, bytearray] = {}
        self.mappings: dict[int, tuple[int, int]] = {}  # ptr -> (handle, size)
        self.access: dict[int, Any] = {}
        self.registered: dict[int, int] = {}
        self.retained: list[int] = []

    # ---- helpers for tests ----

    def _log(self, op: str, *args: Any) -> CUresult | None:
        self.calls.append((op, args))
        return self.fail.pop(op, None)

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    @property
    def used(self) -> int:
        return sum(len(b) for b in self.handles.values())

    def memory(self, ptr: int) -> bytearray:
        """The physical memory mapped at `ptr`; raises like an illegal address when nothing is."""
        mapping = self.mappings.get(int(ptr))
        if mapping is None:
            raise RuntimeError(f"illegal address 0x{int(ptr):x}: nothing mapped")
        return self.handles[mapping[0]]

    def current(self) -> int:
        stack: list[int] = getattr(self._tls, "stack", [])
        return stack[-1] if stack else 0

    def set_current_for_test(self, ctx: int) -> None:
        self._tls.stack = [ctx] if ctx else []

    @staticmethod
    def context_of(device: int) -> int:
        return 0x1000 + device

    # ---- init and contexts ----

    def cuInit(self, flags: int) -> tuple[CUresult]:
        return (self._log("cuInit", flags) or OK,)

    def cuGetErrorString(self, result: CUresult) -> tuple[CUresult, bytes]:
        return OK, f"fake {result.name}".encode()

    def cuDeviceGet(self, ordinal: int) -> tuple[CUresult, int | None]:
        err = self._log("cuDeviceGet", ordinal)
        if err or not 0 <= ordinal < self.devices:
            return err or CUresult.CUDA_ERROR_INVALID_VALUE, None
        return OK, ordinal

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[CUresult, int | None]:
        err = self._log("cuDeviceGetAttribute", attr, dev)
        return (err, None) if err else (OK, 1)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[CUresult, _Ctx | None]:
        err = self._log("cuDevicePrimaryCtxRetain", dev)
        if err:
            return err, None
        self.retained.append(dev)
        return OK, _Ctx(self.context_of(dev))

    def cuCtxGetCurrent(self) -> tuple[CUresult, _Ctx]:
        self._log("cuCtxGetCurrent")
        return OK, _Ctx(self.current())

    def cuCtxGetDevice(self) -> tuple[CUresult, int | None]:
        self._log("cuCtxGetDevice")
        ctx = self.current()
        if not ctx:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return OK, ctx - 0x1000

    def cuCtxPushCurrent(self, ctx: int) -> tuple[CUresult]:
        self._log("cuCtxPushCurrent", int(ctx))
        self._tls.stack = [*getattr(self._tls, "stack", []), int(ctx)]
        return (OK,)

    def cuCtxPopCurrent(self) -> tuple[CUresult, _Ctx | None]:
        self._log("cuCtxPopCurrent")
        stack: list[int] = getattr(self._tls, "stack", [])
        if not stack:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return OK, _Ctx(stack.pop())

    def _need_context(self) -> CUresult | None:
        return None if self.current() else CUresult.CUDA_ERROR_INVALID_CONTEXT

    def cuCtxSynchronize(self) -> tuple[CUresult]:
        return (self._log("cuCtxSynchronize") or self._need_context() or OK,)

    def cuMemGetInfo(self) -> tuple[CUresult, int | None, int | None]:
        err = self._log("cuMemGetInfo") or self._need_context()
        if err:
            return err, None, None
        return OK, self.total - self.used, self.total

    # ---- virtual memory management ----

    def cuMemGetAllocationGranularity(
        self, prop: CUmemAllocationProp, flags: int
    ) -> tuple[CUresult, int | None]:
        err = self._log("cuMemGetAllocationGranularity", prop, flags)
        return (err, None) if err else (OK, self.granularity)

    def cuMemAddressReserve(
        self, size: int, alignment: int, addr: int, flags: int
    ) -> tuple[CUresult, _Ptr | None]:
        err = self._log("cuMemAddressReserve", size, alignment, addr, flags)
        if err or size % self.granularity or (alignment and self._next_va % alignment):
            return err or CUresult.CUDA_ERROR_INVALID_VALUE, None
        ptr = self._next_va
        self._next_va += size + self.granularity  # a gap, so neighbours never touch
        self.reservations[ptr] = size
        return OK, _Ptr(ptr)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[CUresult]:
        err = self._log("cuMemAddressFree", int(ptr), size)
        if err or self.reservations.get(int(ptr)) != size or int(ptr) in self.mappings:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reservations[int(ptr)]
        return (OK,)

    def cuMemCreate(
        self, size: int, prop: CUmemAllocationProp, flags: int
    ) -> tuple[CUresult, _Handle | None]:
        err = self._log("cuMemCreate", size, prop, flags)
        if err:
            return err, None
        if size % self.granularity or prop.location.id >= self.devices:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if self.used + size > self.total:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = bytearray([GARBAGE]) * size
        return OK, _Handle(handle)

    def cuMemRelease(self, handle: int) -> tuple[CUresult]:
        err = self._log("cuMemRelease", int(handle))
        if err or int(handle) not in self.handles:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        if any(h == int(handle) for h, _ in self.mappings.values()):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # this stand-in wants unmap first, as the SDK does
        del self.handles[int(handle)]
        return (OK,)

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[CUresult]:
        err = self._log("cuMemMap", int(ptr), size, offset, int(handle), flags)
        if err:
            return (err,)
        if (
            self.reservations.get(int(ptr)) != size
            or int(ptr) in self.mappings
            or int(handle) not in self.handles
        ):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mappings[int(ptr)] = (int(handle), size)
        return (OK,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[CUresult]:
        err = self._log("cuMemUnmap", int(ptr), size)
        mapping = self.mappings.get(int(ptr))
        if err or mapping is None or mapping[1] != size:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.mappings[int(ptr)]
        self.access.pop(int(ptr), None)
        return (OK,)

    def cuMemSetAccess(self, ptr: int, size: int, desc: list[CUmemAccessDesc], count: int) -> tuple[CUresult]:
        err = self._log("cuMemSetAccess", int(ptr), size, desc, count)
        if err or int(ptr) not in self.mappings or len(desc) != count:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.access[int(ptr)] = (desc[0].location.id, desc[0].flags)
        return (OK,)

    def cuMemsetD8(self, ptr: int, value: int, n: int) -> tuple[CUresult]:
        err = self._log("cuMemsetD8", int(ptr), value, n)
        if err:
            return (err,)
        mem = self.memory(ptr)
        mem[:n] = bytes([value]) * n
        return (OK,)

    def cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> tuple[CUresult]:
        err = self._log("cuMemHostRegister", address, nbytes, flags)
        if err:
            return (err,)
        self.registered[address] = nbytes
        return (OK,)

    def cuMemHostUnregister(self, address: int) -> tuple[CUresult]:
        err = self._log("cuMemHostUnregister", address)
        if err or address not in self.registered:
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.registered[address]
        return (OK,)


class FakeEngine:
    """A TransferEngine over FakeDriver memory: what TorchEngine does with CUDA copies, with slicing."""

    instances: ClassVar[list[FakeEngine]] = []

    def __init__(self, region: VmmRegion) -> None:
        self.region = region
        self.driver: FakeDriver = region.driver
        self.buffers: list[MmapBuffer] = []
        self.uploads = 0
        self.downloads = 0
        self.closed = False
        FakeEngine.instances.append(self)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        buf = MmapBuffer(nbytes)
        self.buffers.append(buf)
        return buf

    def download(self, offset: int, buf: HostBuffer, nbytes: int) -> None:
        mem = self.driver.memory(self.region.ptr)
        buf.view()[:nbytes] = mem[offset : offset + nbytes]
        self.downloads += 1

    def upload(self, buf: HostBuffer, nbytes: int, offset: int) -> None:
        mem = self.driver.memory(self.region.ptr)
        mem[offset : offset + nbytes] = buf.view()[:nbytes]
        self.uploads += 1

    def count_escapes(self, offset: int, nbytes: int) -> int:
        return count_escapes(self.driver.memory(self.region.ptr)[offset : offset + nbytes])

    def download_coded(self, offset: int, buf: HostBuffer, nbytes: int) -> int:
        record = encode_coded(self.driver.memory(self.region.ptr)[offset : offset + nbytes])
        assert record is not None, "download_coded of a chunk with too many escapes"
        buf.view()[: len(record)] = record
        self.downloads += 1
        return len(record)

    def upload_coded(self, buf: HostBuffer, nbytes: int, offset: int, escapes: int) -> None:
        mem = self.driver.memory(self.region.ptr)
        mem[offset : offset + nbytes] = decode_coded(buf.view(), nbytes, escapes)
        self.uploads += 1

    def wait_upload(self, buf: HostBuffer) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()
        self.closed = True
