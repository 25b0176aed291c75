"""GPU memory whose physical backing can be given back and taken again at the same virtual addresses.

Why: the CUDA checkpoint API copies every byte of a process's device memory into host memory, and the
restore copies it back. A KV cache (tens of GiB of scratch) and the weights (which exist on disk anyway)
are most of those bytes. A VmmRegion reserves a virtual address range once (cuMemAddressReserve) and
backs it with physical memory (cuMemCreate + cuMemMap + cuMemSetAccess). release() unmaps and frees the
physical memory but keeps the reservation, so nothing in it is checkpointed; reacquire() maps fresh
physical memory at the *same* address, so tensors, kernel arguments and captured CUDA graphs that hold
those addresses stay valid. The contents after reacquire() are undefined: a KV cache does not care,
weights are loaded again (weights.py).

The CUDA context: driver calls act on the calling thread's current context. A worker's context is
PyTorch's, which is the device's *primary* context (the runtime API uses it and makes it current on
each thread that touches the device). Every operation here therefore first looks at the thread's
current context: if it is on the region's device it is used as it is; otherwise (a fresh thread, or a
context of another device) the device's primary context is retained once and pushed for the duration
of the call, then popped, so the caller's thread state is left as it was. Calling torch.cuda.init() (or
any CUDA op) before creating a region is not required but is the normal order in a worker.

Tensors: as_tensor() returns a torch tensor that views the region without copying. The documented way
is an object with __cuda_array_interface__ passed to torch.as_tensor; PyTorch implements that
interface through NumPy's dtype parser, so where NumPy is not installed the same view is made with
torch's storage-from-pointer constructor instead (`tensor_path` says which one was used).

Lifetime: a region is never freed implicitly (a view may outlive every Python reference to the region,
and freeing under it would turn the next kernel into an illegal address error that kills the CUDA
context). free() it explicitly, after dropping its views. Touching a view while the region is released
has the same fatal effect: release only when nothing will run on it until reacquire().

cuda-python is imported on first use, like dynamo_snapshot.cuda.checkpoint; torch only in as_tensor().
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from collections.abc import Iterator
from typing import Any, Final, Literal

from dynamo_snapshot.cuda.checkpoint import import_driver, result_name
from dynamo_snapshot.cuda.errors import CudaError, CudaUnavailableError, describe_result

__all__ = [
    "DEFAULT_POOL",
    "KIND_KV",
    "KIND_WEIGHTS",
    "RegionPool",
    "TensorPath",
    "VmmRegion",
    "allocation_granularity",
    "device_memory_info",
    "register_host_memory",
    "round_up",
    "unregister_host_memory",
]

KIND_KV: Final = "kv"
KIND_WEIGHTS: Final = "weights"

TensorPath = Literal["cuda_array_interface", "storage_pointer"]
_VIA = ("auto", "cuda_array_interface", "storage_pointer")

_SUCCESS: Final = "CUDA_SUCCESS"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ---- driver plumbing ------------------------------------------------------------------------------


_describe = describe_result


def _call(driver: Any, op: str, *args: Any) -> tuple[Any, ...]:
    """driver.op(*args) -> the values after the CUresult; CudaError when the CUresult is not success.

    cuda-bindings returns (CUresult, value...) and, on failure, None for the values: they are only
    looked at after the check.
    """
    out = getattr(driver, op)(*args)
    result, *values = out if isinstance(out, tuple) else (out,)
    name = result_name(result)
    if name != _SUCCESS:
        raise CudaError(op, None, name, _describe(driver, result))
    return tuple(values)


def _driver(driver: Any | None) -> Any:
    d = driver if driver is not None else import_driver()
    # cuInit is idempotent and cheap after the first call; a missing driver surfaces here, clearly.
    out = d.cuInit(0)
    result = out[0] if isinstance(out, tuple) else out
    if result_name(result) != _SUCCESS:
        raise CudaUnavailableError(f"no NVIDIA driver: cuInit failed with {result_name(result)}")
    return d


# Primary contexts retained by this module, per (driver, ordinal): retained once, never released, so
# the context outlives every region (the worker's own runtime holds it for the process's life anyway).
_primary: dict[tuple[int, int], Any] = {}
_primary_lock = threading.Lock()


def _primary_context(driver: Any, device: int) -> Any:
    key = (id(driver), device)
    with _primary_lock:
        ctx = _primary.get(key)
        if ctx is None:
            (dev,) = _call(driver, "cuDeviceGet", device)
            (ctx,) = _call(driver, "cuDevicePrimaryCtxRetain", dev)
            _primary[key] = ctx
        return ctx


@contextlib.contextmanager
def _on_device(driver: Any, device: int) -> Iterator[None]:
    """Make a context of `device` current on this thread for the block, leaving the thread as it was."""
    (current,) = _call(driver, "cuCtxGetCurrent")
    if current is not None and int(current) != 0:
        (dev,) = _call(driver, "cuCtxGetDevice")
        if int(dev) == device:
            yield  # the caller's own context (torch's primary context, normally)
            return
    _call(driver, "cuCtxPushCurrent", _primary_context(driver, device))
    try:
        yield
    finally:
        _call(driver, "cuCtxPopCurrent")


def _allocation_prop(driver: Any, device: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    # No shareable handle type: the memory never leaves this process, and memory exported as a POSIX fd
    # is what the driver's checkpoint does not handle on its own (it needs an interposer).
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    return prop


def _granularity(driver: Any, prop: Any) -> int:
    flags = driver.CUmemAllocationGranularity_flags
    (gran,) = _call(driver, "cuMemGetAllocationGranularity", prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return int(gran)


def allocation_granularity(device: int = 0, *, driver: Any | None = None) -> int:
    """The size unit of a VmmRegion on `device` (2 MiB on an H200): sizes are rounded up to it."""
    d = _driver(driver)
    with _on_device(d, device):
        return _granularity(d, _allocation_prop(d, device))


def device_memory_info(device: int = 0, *, driver: Any | None = None) -> tuple[int, int]:
    """(free, total) bytes of `device`, as cuMemGetInfo reports them to a context on it."""
    d = _driver(driver)
    with _on_device(d, device):
        free, total = _call(d, "cuMemGetInfo")
        return int(free), int(total)


def register_host_memory(address: int, nbytes: int, device: int = 0, *, driver: Any | None = None) -> None:
    """Page-lock `nbytes` of ordinary host memory at `address` (cuMemHostRegister, portable) so copies
    between it and the GPU are DMA, asynchronous to the host.

    Used instead of cudaHostAlloc'd memory for the weights' read buffers: those are mapped from the
    NVIDIA device file, and O_DIRECT (which needs the kernel to pin the pages itself) may refuse them;
    anonymous memory registered here stays ordinary pages that O_DIRECT can read into.
    """
    d = _driver(driver)
    with _on_device(d, device):
        _call(d, "cuMemHostRegister", address, nbytes, d.CU_MEMHOSTREGISTER_PORTABLE)


def unregister_host_memory(address: int, device: int = 0, *, driver: Any | None = None) -> None:
    """Undo register_host_memory; no copy from or to the memory may still be in flight."""
    d = _driver(driver)
    with _on_device(d, device):
        _call(d, "cuMemHostUnregister", address)


# ---- regions --------------------------------------------------------------------------------------


class _CudaArray:
    """The __cuda_array_interface__ (v3) of `nbytes` bytes at `ptr`.

    torch.as_tensor keeps a reference to this object for as long as the tensor's storage lives, and
    this object keeps the region: a view can never outlive the region's Python object.
    """

    def __init__(self, ptr: int, nbytes: int, owner: VmmRegion) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise CudaUnavailableError("torch is not installed: tensor views of GPU memory need it") from None


class VmmRegion:
    """`size_bytes` (rounded up to the allocation granularity) of device memory at a stable address.

    `kind` registers the region in `pool` (default DEFAULT_POOL) so the SDK can release and reacquire
    all regions of a kind; free() unregisters it. `driver` replaces cuda.bindings.driver (tests).
    Thread-safe: state changes are serialised per region.
    """

    def __init__(
        self,
        size_bytes: int,
        device: int = 0,
        *,
        kind: str | None = None,
        pool: RegionPool | None = None,
        driver: Any | None = None,
    ) -> None:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be a CUDA device ordinal, got {device!r}")
        self._cu = _driver(driver)
        self._device = device
        self._lock = threading.RLock()
        self._handle: Any = None
        self._freed = False
        self._tensor_path: TensorPath | None = None
        with _on_device(self._cu, device):
            (dev,) = _call(self._cu, "cuDeviceGet", device)
            attr = self._cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            (supported,) = _call(self._cu, "cuDeviceGetAttribute", attr, dev)
            if not int(supported):
                detail = f"device {device} has no virtual memory management"
                raise CudaError("cuDeviceGetAttribute", None, _SUCCESS, detail)
            self._prop = _allocation_prop(self._cu, device)
            self._granularity = _granularity(self._cu, self._prop)
            self._size = round_up(size_bytes, self._granularity)
            # Aligned to the granularity: cuMemMap needs the address aligned to it.
            (ptr,) = _call(self._cu, "cuMemAddressReserve", self._size, self._granularity, 0, 0)
            self._ptr = int(ptr)
            try:
                self._map()
            except BaseException:
                with contextlib.suppress(CudaError):
                    _call(self._cu, "cuMemAddressFree", self._ptr, self._size)
                raise
        self._pool: RegionPool | None = None
        self._kind = kind
        if kind is not None:
            self._pool = pool if pool is not None else DEFAULT_POOL
            self._pool.add(self, kind)

    # ---- properties ----

    @property
    def ptr(self) -> int:
        """The device address of the first byte; the same for the region's whole life."""
        return self._ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> int:
        return self._device

    @property
    def driver(self) -> Any:
        """The cuda.bindings.driver module (or stand-in) this region calls."""
        return self._cu

    @property
    def kind(self) -> str | None:
        return self._kind

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def mapped(self) -> bool:
        """True while physical memory backs the range (between creation/reacquire and release/free)."""
        return self._handle is not None

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def tensor_path(self) -> TensorPath | None:
        """How the last as_tensor() made its view; None before the first."""
        return self._tensor_path

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("mapped" if self.mapped else "released")
        return f"VmmRegion(ptr=0x{self._ptr:x}, size={self._size}, device={self._device}, {state})"

    # ---- physical memory ----

    def _map(self) -> None:
        cu = self._cu
        (handle,) = _call(cu, "cuMemCreate", self._size, self._prop, 0)
        try:
            _call(cu, "cuMemMap", self._ptr, self._size, 0, handle, 0)
        except BaseException:
            with contextlib.suppress(CudaError):
                _call(cu, "cuMemRelease", handle)
            raise
        try:
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self._device
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            # Access rights belong to the mapping, not to the reservation: set again after every map.
            _call(cu, "cuMemSetAccess", self._ptr, self._size, [access], 1)
        except BaseException:
            with contextlib.suppress(CudaError):
                _call(cu, "cuMemUnmap", self._ptr, self._size)
            with contextlib.suppress(CudaError):
                _call(cu, "cuMemRelease", handle)
            raise
        self._handle = handle

    def _check_alive(self, op: str) -> None:
        if self._freed:
            raise RuntimeError(f"{op}: {self!r} was freed")

    def release(self) -> int:
        """Unmap and free the physical memory, keeping the address range; bytes given back (0 if
        already released). Waits for all work in the device's context first, so no kernel still runs
        on the memory when it goes."""
        with self._lock:
            self._check_alive("release")
            if self._handle is None:
                return 0
            with _on_device(self._cu, self._device):
                _call(self._cu, "cuCtxSynchronize")
                _call(self._cu, "cuMemUnmap", self._ptr, self._size)
                handle, self._handle = self._handle, None
                # Unmapped already: if this failed the memory would leak, but the range stays usable.
                _call(self._cu, "cuMemRelease", handle)
            return self._size

    def reacquire(self) -> int:
        """Back the range with new physical memory at the same address; bytes mapped (0 if it was
        mapped). The contents are undefined. CudaError (CUDA_ERROR_OUT_OF_MEMORY) when the device has
        no room: the region then stays released and the call can be retried."""
        with self._lock:
            self._check_alive("reacquire")
            if self._handle is not None:
                return 0
            with _on_device(self._cu, self._device):
                self._map()
            return self._size

    def free(self) -> None:
        """release() and give the address range back; the region is unusable afterwards. Idempotent."""
        with self._lock:
            if self._freed:
                return
            self.release()
            with _on_device(self._cu, self._device):
                _call(self._cu, "cuMemAddressFree", self._ptr, self._size)
            self._freed = True
        if self._pool is not None:
            self._pool.remove(self)
            self._pool = None

    def zero(self) -> None:
        """Set every byte to 0 and wait for it (e.g. after reacquire(), where contents are undefined)."""
        with self._lock:
            self._check_alive("zero")
            if self._handle is None:
                raise RuntimeError(f"zero: {self!r} is released")
            with _on_device(self._cu, self._device):
                _call(self._cu, "cuMemsetD8", self._ptr, 0, self._size)
                _call(self._cu, "cuCtxSynchronize")

    # ---- tensors ----

    def as_tensor(
        self,
        dtype: Any,
        shape: tuple[int, ...] | list[int],
        offset: int = 0,
        *,
        via: Literal["auto", "cuda_array_interface", "storage_pointer"] = "auto",
    ) -> Any:
        """A contiguous torch tensor of `dtype` and `shape` over the region's bytes from `offset`,
        sharing the memory (no copy). `offset` must be a multiple of the element size.

        `via` forces one construction (tests); "auto" tries __cuda_array_interface__ and falls back to
        the storage pointer when torch cannot take the interface (no NumPy).
        """
        if via not in _VIA:
            raise ValueError(f"via must be one of {_VIA}, got {via!r}")
        torch = _import_torch()
        dims = tuple(int(s) for s in shape)
        if any(s < 0 for s in dims):
            raise ValueError(f"negative dimension in shape {dims}")
        itemsize = int(torch.empty((), dtype=dtype).element_size())
        nbytes = math.prod(dims) * itemsize
        if offset < 0 or offset % itemsize:
            raise ValueError(f"offset {offset} is not a non-negative multiple of the element size {itemsize}")
        if offset + nbytes > self._size:
            raise ValueError(f"{nbytes} bytes at offset {offset} do not fit in a region of {self._size}")
        self._check_alive("as_tensor")
        raw = self._bytes_view(torch, self._ptr + offset, nbytes, via)
        # Made as bytes and reinterpreted: the array interface has no typestr for bfloat16 or fp8.
        return raw.view(dtype).view(dims)

    def _bytes_view(self, torch: Any, ptr: int, nbytes: int, via: str) -> Any:
        device = torch.device("cuda", self._device)
        t: Any = None
        path: TensorPath = "cuda_array_interface"
        if via in ("auto", "cuda_array_interface"):
            try:
                t = torch.as_tensor(_CudaArray(ptr, nbytes, self), device=device)
                if nbytes and int(t.data_ptr()) != ptr:
                    # as_tensor copies when the device it infers from the pointer is not `device`.
                    raise RuntimeError(f"torch.as_tensor copied 0x{ptr:x} instead of viewing it")
            except (RuntimeError, TypeError, ValueError):
                # "Numpy is not available": PyTorch parses the typestr with NumPy.
                t = None
                if via != "auto":
                    raise
        if t is None:
            # A storage that does not own its memory (no deleter): freeing stays with the region.
            storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
            t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
            path = "storage_pointer"
        if nbytes and int(t.data_ptr()) != ptr:
            raise RuntimeError(f"torch copied the region instead of viewing it ({path}): 0x{ptr:x}")
        self._tensor_path = path
        return t


class RegionPool:
    """Regions by kind ("kv", "weights", ...), in registration order, to release or reacquire together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[str, VmmRegion]] = {}

    def add(self, region: VmmRegion, kind: str) -> None:
        with self._lock:
            self._regions[id(region)] = (kind, region)

    def remove(self, region: VmmRegion) -> None:
        with self._lock:
            self._regions.pop(id(region), None)

    def regions(self, kind: str | None = None) -> list[VmmRegion]:
        with self._lock:
            return [r for k, r in self._regions.values() if kind is None or k == kind]

    def release(self, kind: str | None = None) -> int:
        """Release every region of `kind` (all when None); bytes given back."""
        return sum(r.release() for r in self.regions(kind))

    def reacquire(self, kind: str | None = None) -> int:
        """Reacquire every region of `kind` (all when None); bytes mapped."""
        return sum(r.reacquire() for r in self.regions(kind))

    def mapped_bytes(self, kind: str | None = None) -> int:
        return sum(r.size for r in self.regions(kind) if r.mapped)


DEFAULT_POOL: Final = RegionPool()
