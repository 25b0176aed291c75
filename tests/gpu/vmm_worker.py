"""A worker for vmm_scenarios.checkpoint_cycle: KV cache and weights in VmmRegions, a CUDA graph over
both, and the snapshot handshake.

Usage: python -m tests.gpu.vmm_worker WORKDIR MODE WEIGHTS_FILE KV_MIB WEIGHTS_MIB

MODE "release" registers the KV cache and the weights with the handshake, so they are released (the
weights saved to WEIGHTS_FILE first) before ready-for-snapshot and taken back after restore-complete;
MODE "keep" registers nothing, so the CUDA checkpoint carries all of it. Either way, once the wait ends
the worker checks that the addresses did not move, the weights are bit-exact, a replay of the graph
gives the result it gave before and a matmul on the weights is bit-exact, and writes
WORKDIR/result.json. The handshake's control dir is WORKDIR/control. Needs torch and this repository.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

work = Path(sys.argv[1])
mode = sys.argv[2]
weights_file = Path(sys.argv[3])
kv_mib = int(sys.argv[4])
weights_mib = int(sys.argv[5])


def write_json(name: str, obj: object) -> None:
    tmp = work / f".{name}.tmp"
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, work / name)


def checksum(t: Any) -> int:
    """Sum of the tensor's bytes read as int64 (or uint8 when the size is not a multiple of 8); integer
    addition wraps and is associative, so this is exact and the same however the GPU reduces it."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() % 8 == 0:
        return int(flat.view(torch.int64).sum().item())
    return int(flat.sum(dtype=torch.int64).item())


def main() -> None:
    import torch

    from dynamo_snapshot.workload import KvCache, RegionPool, SnapshotHandshake, WeightRegion

    started = time.time()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(20270301)

    kv = KvCache(kv_mib << 20, device=0, pool=RegionPool())
    kv_t = kv.allocate("kv", ((kv_mib << 20) // 2,), torch.float16)

    named = [
        (f"w{i}", torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev, generator=gen))
        for i in range(max(1, weights_mib // 32))
    ]
    named.append(("odd", torch.randint(0, 256, (12345,), dtype=torch.uint8, device=dev, generator=gen)))
    weights = WeightRegion(device=0, pool=RegionPool())
    views = weights.pack(named)
    del named
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the originals are gone: only the regions hold weights now
    sums = {name: checksum(v) for name, v in views.items()}

    x = torch.randn(4096, 256, dtype=torch.bfloat16, device=dev, generator=gen)
    n = 4096 * 256

    def step() -> Any:
        y = views["w0"] @ x
        kv_t[:n].copy_(y.reshape(-1))
        return torch.sum(kv_t[:n], dtype=torch.float32)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    out_ref = float(out.item())
    kv_ref = kv_t[:n].clone()
    mm_ref = views["w0"] @ x
    torch.cuda.synchronize()

    kv_ptr = kv.region.ptr
    assert weights.region is not None
    weights_ptr = weights.region.ptr
    ptrs = {name: int(v.data_ptr()) for name, v in views.items()}
    free, total = torch.cuda.mem_get_info(dev)

    handshake = SnapshotHandshake(work / "control")
    if mode == "release":
        handshake.register_kv_cache(kv)
        handshake.register_weights(weights, weights_file)
    write_json(
        "pre.json",
        {
            "pid": os.getpid(),
            "kv_bytes": kv.size,
            "weights_bytes": weights.region.size,
            "gpu_free_mib": free >> 20,
            "gpu_total_mib": total >> 20,
            "tensor_path": kv.region.tensor_path,
            "setup_s": round(time.time() - started, 2),
        },
    )
    waited = time.monotonic()
    info = handshake.checkpoint_and_wait(poll_interval=0.05, timeout=600)
    resumed = time.monotonic()

    result: dict[str, Any] = {
        "mode": mode,
        "restored": info.restored,
        "wait_s": round(resumed - waited, 3),
        "kv_mapped": kv.region.mapped,
        "weights_mapped": weights.region.mapped,
        "ptrs_ok": kv.region.ptr == kv_ptr
        and weights.region.ptr == weights_ptr
        and all(int(v.data_ptr()) == ptrs[k] for k, v in views.items())
        and int(kv_t.data_ptr()) == kv_ptr,
    }
    if mode == "release":
        result["offload"] = handshake.gpu_offload.report.to_dict()
    bad = [name for name, v in views.items() if checksum(v) != sums[name]]
    result["weights_ok"] = not bad
    result["weights_bad"] = bad[:5]
    result["mm_ok"] = bool(torch.equal((views["w0"] @ x).view(torch.int16), mm_ref.view(torch.int16)))
    kv_t[:n].zero_()
    out.zero_()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    result["graph_ok"] = float(out.item()) == out_ref and bool(
        torch.equal(kv_t[:n].view(torch.int16), kv_ref.view(torch.int16))
    )
    fresh = torch.ones(1 << 20, device=dev)
    result["fresh_alloc_ok"] = int(fresh.sum().item()) == 1 << 20
    result["verify_s"] = round(time.monotonic() - resumed, 3)
    write_json("result.json", result)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        write_json("result.json", {"error": traceback.format_exc()})
        sys.exit(1)
