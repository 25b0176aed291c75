"""A CPU stand-in for a worker with decoupled weights: it writes a weights file in the SDK's format
under its control dir and lists it in weights.json (as GpuOffload does after saving and releasing a
WeightRegion), drops the bytes from memory, and after the restore reads the file the agent put back
and writes verify.json saying whether it holds exactly the weights it saved."""

from __future__ import annotations

import hashlib
import json
import os
import time

from dynamo_snapshot.workload import SnapshotHandshake
from dynamo_snapshot.workload.weights import (
    ArrivingReader,
    WeightsArrival,
    WeightsFile,
    WeightsHeader,
    data_digest,
    plan_layout,
    read_header,
    wait_for_weights_verified,
    weights_arriving,
    weights_check_pending,
    write_weights_manifest,
)

CHUNK = 1 << 20
nbytes = int(os.environ.get("WORKER_WEIGHTS_MIB", "3")) << 20
data = os.urandom(nbytes)
digests = [hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, nbytes, CHUNK)]
specs, _ = plan_layout([("w", "uint8", (nbytes,), nbytes)], 256)
header = WeightsHeader(
    tensors=tuple(specs),
    data_bytes=nbytes,
    device_bytes=nbytes,
    chunk_bytes=CHUNK,
    chunk_sha256=tuple(digests),
    data_digest=data_digest(digests),
)
handshake = SnapshotHandshake()
path = handshake.control_dir / "weights" / "model.dsw"
path.parent.mkdir(parents=True, exist_ok=True)
content = header.encode() + data
path.write_bytes(content)
whole = hashlib.sha256(content).hexdigest()  # what the restored worker must read back
# A hostile tenant's weights file: the same bytes at WORKER_OUTSIDE (another pod's or the host's file),
# reached from the control dir through a link; the agent must carry nothing from there.
plant = os.environ.get("WORKER_PLANT")
if plant:
    outside = os.environ["WORKER_OUTSIDE"]
    os.makedirs(outside, exist_ok=True)
    target = os.path.join(outside, "model.dsw")
    os.replace(path, target)
    if plant == "symlink":
        os.symlink(target, path)
    elif plant == "hardlink":
        os.link(target, path)
    elif plant == "dirlink":
        os.rmdir(path.parent)
        os.symlink(outside, path.parent)
    else:
        raise SystemExit(f"unknown WORKER_PLANT {plant!r}")
write_weights_manifest(
    handshake.control_dir,
    [WeightsFile(str(path), len(content), header.data_digest, 0)],
    {0: nbytes},
    # As GpuOffload does: this worker waits for the agent's verdict before it uses the weights.
    waits_for_weights_check=os.environ.get("WORKER_WAITS_FOR_CHECK", "1") == "1",
    reads_arriving_weights=os.environ.get("WORKER_READS_ARRIVING", "0") == "1",
)
del data, content  # released: from here on only the file holds the weights
handshake.signal_ready()
info = handshake.wait_for_restore()
got = b""
if weights_arriving(info.content):
    # As the SDK's load does: every read waits for its bytes; what was in at the first read is recorded.
    (handshake.control_dir / "reading-while-arriving").touch()  # tests look for this
    arrival = WeightsArrival(handshake.control_dir, timeout=120)
    first = arrival.arrived(str(path))
    reader = ArrivingReader(path, False, arrival)
    size = os.path.getsize(path)
    buf = bytearray(size)
    for offset in range(0, size, CHUNK):
        reader.read(memoryview(buf)[offset : offset + CHUNK], offset)
    reader.close()
    got = buf  # type: ignore[assignment]
    loaded = {"first_arrived": first, "size": len(got)}
    (handshake.control_dir / "loaded-while-arriving.json").write_text(json.dumps(loaded))  # tests read it
if weights_check_pending(info.content):
    (handshake.control_dir / "loading-before-verdict").touch()  # tests look for this
    wait_for_weights_verified(handshake.control_dir, timeout=120)
got = got or path.read_bytes()
read_back, _ = read_header(path)
verdict = {
    "weights_ok": hashlib.sha256(got).hexdigest() == whole,
    "digest_ok": read_back.data_digest == header.data_digest,
    "restored": info.restored,
}
tmp = handshake.control_dir / ".verify.tmp"
tmp.write_text(json.dumps(verdict))
os.replace(tmp, handshake.control_dir / "verify.json")
while True:
    time.sleep(1)
