"""A CPU stand-in worker for the agent tests: holds random state only in memory, uses the workload
handshake, and after a restore writes verify.json proving the state survived (checksum) and who it is now."""

from __future__ import annotations

import hashlib
import json
import os
import time

from dynamo_snapshot.workload import SnapshotHandshake

# A quarter random bytes, the rest drawn from four letters: no zero pages, and it compresses about as
# well as a real worker's memory does (the agent stores the pages images compressed).
size = int(os.environ.get("WORKER_STATE_MIB", "32")) << 20
state = bytearray(os.urandom(size // 4) + os.urandom(size - size // 4).translate(b"acgt" * 64))
# Memory the worker wrote zeros into (WORKER_ZERO_MIB): pages CRIU dumps, all zero.
zeros = bytearray(int(os.environ.get("WORKER_ZERO_MIB", "0")) << 20)
zeros[:] = bytes(len(zeros))
digest = hashlib.sha256(state).hexdigest()
# A worker that loads for a while, as an engine loading its model does.
time.sleep(float(os.environ.get("WORKER_READY_DELAY_S", "0")))
handshake = SnapshotHandshake()
handshake.signal_ready({"digest": digest})
info = handshake.wait_for_restore()
verdict = {
    "digest_before": digest,
    "digest_after": hashlib.sha256(state).hexdigest(),
    "zeros_intact": zeros.count(0) == len(zeros),
    "pid": os.getpid(),
    "restored": info.restored,
    "pod_name": info.pod_name,
    "restore_info": info.content,
}
tmp = handshake.control_dir / ".verify.tmp"
tmp.write_text(json.dumps(verdict))
os.replace(tmp, handshake.control_dir / "verify.json")
while True:
    time.sleep(1)
