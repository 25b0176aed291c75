"""A small CUDA process for the checkpoint API test: known data on the GPU and a captured CUDA graph.

Usage: cuda_worker.py DIR MIB. Writes DIR/ready.json ({"pid", "bytes", "device"}) once warm, waits for
DIR/go, then checks that the data and a replay of the graph are bit-exact and that new allocations
work, and writes DIR/result.json. Plain files only, so it needs nothing but torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

work = Path(sys.argv[1])
mib = int(sys.argv[2])


def write_json(name: str, obj: object) -> None:
    tmp = work / f".{name}.tmp"
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, work / name)


dev = torch.device("cuda")
gen = torch.Generator(device=dev)
gen.manual_seed(20261129)
data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, device=dev, generator=gen)
host_copy = data.cpu()
a = torch.randn(1024, 1024, device=dev, dtype=torch.float32, generator=gen)


def step() -> torch.Tensor:
    # Reads the big buffer too, so a wrong restore of it would also show in the graph's output.
    return torch.tanh(a @ a) + data[: a.numel()].view(a.shape).float()


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
graph_ref = out.cpu()

write_json("ready.json", {"pid": os.getpid(), "bytes": data.numel(), "device": torch.cuda.get_device_name()})

deadline = time.monotonic() + float(os.environ.get("WORKER_TIMEOUT_S", "900"))
while not (work / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.01)

data_ok = torch.equal(data.cpu(), host_copy)
out.zero_()  # the replay must recompute it, not find it
torch.cuda.synchronize()
graph.replay()
torch.cuda.synchronize()
graph_ok = torch.equal(out.cpu(), graph_ref)
fresh = torch.ones(1 << 20, device=dev)
fresh_ok = int(fresh.sum().item()) == 1 << 20
write_json("result.json", {"data_ok": data_ok, "graph_ok": graph_ok, "fresh_alloc_ok": fresh_ok})
