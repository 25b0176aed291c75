"""A stand-in GPU inference worker for the agent's GPU test and benchmark: loads raw weights from disk onto
the GPU, captures a CUDA graph, uses the workload handshake, and after a restore proves that the weights
and the graph replay are bit-exact. Usage: torch_worker.py WEIGHTS_FILE"""

from __future__ import annotations

import json
import os
import sys
import time

t0 = time.time()
import torch  # noqa: E402  (timed: importing torch is part of a cold start)

from dynamo_snapshot.workload import SnapshotHandshake  # noqa: E402

t_import = time.time()
torch.cuda.init()
torch.empty(1, device="cuda")
t_ctx = time.time()

weights_file = sys.argv[1]
size = os.path.getsize(weights_file)
weights = torch.empty(size, dtype=torch.uint8, device="cuda")
chunk = 1 << 30
pinned = torch.empty(chunk, dtype=torch.uint8).pin_memory()
with open(weights_file, "rb", buffering=0) as f:
    off = 0
    while off < size:
        n = f.readinto(memoryview(pinned.numpy()))
        if not n:
            break
        weights[off : off + n].copy_(pinned[:n])
        off += n
del pinned
torch.cuda.synchronize()
t_load = time.time()

a = torch.randn(
    4096, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(7)
)
graph = torch.cuda.CUDAGraph()
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    b = a @ a
torch.cuda.synchronize()
with torch.cuda.graph(graph):
    b = a @ a
graph.replay()
torch.cuda.synchronize()
graph_ref = b.float().sum().item()
weights_ref = int(weights.view(torch.int64).sum().item())
t_ready = time.time()

handshake = SnapshotHandshake()
timings = {
    "import": t_import - t0,
    "context": t_ctx - t_import,
    "load": t_load - t_ctx,
    "warmup": t_ready - t_load,
    "total": t_ready - t0,
    "started_at": t0,
    "ready_at": t_ready,
}
(handshake.control_dir / "cold-timings.json").write_text(json.dumps(timings))
handshake.signal_ready({"weights_bytes": size})
handshake.wait_for_restore()
resumed = time.time()
weights_now = int(weights.view(torch.int64).sum().item())
graph.replay()
torch.cuda.synchronize()
graph_now = b.float().sum().item()
verdict = {
    "weights_ok": weights_now == weights_ref,
    "graph_ok": graph_now == graph_ref,
    "resumed_at": resumed,
    "verified_at": time.time(),
}
tmp = handshake.control_dir / ".verify.tmp"
tmp.write_text(json.dumps(verdict))
os.replace(tmp, handshake.control_dir / "verify.json")
time.sleep(float(os.environ.get("WORKER_LINGER_S", "5")))
