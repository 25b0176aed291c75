"""Without cuda-python or nvidia-ml-py the package imports, and every call says what to install."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot import cuda
from dynamo_snapshot.cuda import CudaCheckpointer, CudaUnavailableError, NvmlUnavailableError

PID = 1  # never reached: the missing module is found first


@pytest.fixture(autouse=True)
def no_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import x` raise ImportError, whether or not x is installed here.
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "pynvml"):
        monkeypatch.setitem(sys.modules, name, None)


def test_imports_without_cuda_python_in_a_fresh_interpreter() -> None:
    code = (
        "import sys\n"
        "for m in ('cuda', 'cuda.bindings', 'cuda.bindings.driver', 'pynvml'): sys.modules[m] = None\n"
        "import dynamo_snapshot.cuda as c\n"
        "assert not c.cuda_available()\n"
        "assert not any(m.startswith(('cuda.', 'pynvml')) and sys.modules[m] for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cuda_available_is_false() -> None:
    assert cuda.cuda_available() is False


CHECKPOINTER_CALLS: dict[str, Callable[[CudaCheckpointer], Any]] = {
    "state": lambda c: c.state(PID),
    "lock": lambda c: c.lock(PID),
    "checkpoint": lambda c: c.checkpoint(PID),
    "restore": lambda c: c.restore(PID),
    "restore_remap": lambda c: c.restore(PID, {"GPU-" + "0" * 32: "GPU-" + "1" * 32}),
    "unlock": lambda c: c.unlock(PID),
    "restore_thread_id": lambda c: c.restore_thread_id(PID),
    "suspend": lambda c: c.suspend(PID),
    "resume": lambda c: c.resume(PID),
    "driver_version": lambda c: c.driver_version(),
}


@pytest.mark.parametrize("call", CHECKPOINTER_CALLS.values(), ids=CHECKPOINTER_CALLS.keys())
def test_every_checkpointer_call_names_the_install(call: Callable[[CudaCheckpointer], Any]) -> None:
    with pytest.raises(CudaUnavailableError) as e:
        call(CudaCheckpointer())
    assert str(e.value) == "cuda-python is not installed (pip install 'dynamo-snapshot[gpu]')"


INVENTORY_CALLS: dict[str, Callable[[], Any]] = {
    "driver_info": cuda.driver_info,
    "list_gpus": cuda.list_gpus,
    "node_gpus": cuda.node_gpus,
    "gpu_memory_by_pid": cuda.gpu_memory_by_pid,
}


@pytest.mark.parametrize("call", INVENTORY_CALLS.values(), ids=INVENTORY_CALLS.keys())
def test_every_inventory_call_names_the_install(call: Callable[[], Any]) -> None:
    with pytest.raises(NvmlUnavailableError) as e:
        call()
    assert isinstance(e.value, CudaUnavailableError)
    assert str(e.value) == "nvidia-ml-py is not installed (pip install 'dynamo-snapshot[gpu]')"
