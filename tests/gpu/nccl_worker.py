"""A one-rank torch.distributed NCCL worker for the communicator scenarios (nccl_scenarios.py).

Usage: nccl_worker.py DIR MODE, MODE "teardown" or "live". Creates a NCCL process group (a FileStore in
DIR), runs an all_reduce so the communicator exists, writes DIR/ready.json. In "teardown" mode it waits
for DIR/prepare, destroys the process group and writes DIR/prepared.json: what a multi-GPU worker does
before it signals ready-for-snapshot. Then it waits for DIR/go (after the CUDA checkpoint and restore),
re-creates the group on a fresh store in "teardown" mode (or keeps the old one in "live" mode), runs an
all_reduce and checks its data, and writes DIR/result.json. Plain files only; needs torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

work = Path(sys.argv[1])
mode = sys.argv[2]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)


def write_json(name: str, obj: object) -> None:
    tmp = work / f".{name}.tmp"
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, work / name)


def wait_for(name: str) -> None:
    deadline = time.monotonic() + float(os.environ.get("WORKER_TIMEOUT_S", "600"))
    while not (work / name).exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)


def group(generation: int) -> None:
    store = dist.FileStore(str(work / f"store-{generation}"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)


def all_reduce_ok(value: float) -> bool:
    t = torch.full((1 << 20,), value, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return bool(torch.all(t == value).item())


gen = torch.Generator(device=dev)
gen.manual_seed(20261202)
data = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device=dev, generator=gen)
host_copy = data.cpu()
group(0)
first_ok = all_reduce_ok(1.0)
write_json(
    "ready.json",
    {
        "pid": os.getpid(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torch": torch.__version__,
        "first_all_reduce_ok": first_ok,
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    },
)
if mode == "teardown":
    wait_for("prepare")
    t = time.perf_counter()
    dist.destroy_process_group()
    torch.cuda.synchronize()
    write_json("prepared.json", {"destroy_s": round(time.perf_counter() - t, 4)})
wait_for("go")
t = time.perf_counter()
if mode == "teardown":
    group(1)
recreate_s = round(time.perf_counter() - t, 4)
ok = all_reduce_ok(3.0)
write_json(
    "result.json",
    {
        "data_ok": torch.equal(data.cpu(), host_copy),
        "all_reduce_ok": ok,
        "recreate_s": recreate_s,
    },
)
dist.destroy_process_group()
