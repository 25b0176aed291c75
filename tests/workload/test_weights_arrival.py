"""Weights read while they still arrive (weights.arrival): a file the agent fills chunk by chunk, and
FILE_WEIGHTS_ARRIVED saying how much of it is in. Every read waits for its bytes, so a load that starts
before the file is whole gets exactly the saved bytes (a read that did not wait would get the zeros the
file was created with); the header first. Bad documents and a stalled arrival are refused by name."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.workload.weights import (
    ENCODINGS,
    ArrivingReader,
    WeightsArrival,
    arrived_document,
    parse_arrived,
    weights_arriving,
)
from tests.workload.fake_cuda import FakeDriver, FakeEngine
from tests.workload.test_weights import CHUNK, cu, device_bytes, fill_weights, make_region

__all__ = ["cu"]  # the fixture, imported for this module's tests


class Arrival(threading.Thread):
    """The agent's side, in small: ``source``'s bytes copied into ``target`` (created at its size, all
    zeros) ``step`` at a time, FILE_WEIGHTS_ARRIVED updated after each, a pause between."""

    def __init__(self, source: Path, target: Path, control_dir: Path, step: int, pause: float) -> None:
        super().__init__(daemon=True)
        self.data = source.read_bytes()
        self.target, self.control_dir, self.step, self.pause = target, control_dir, step, pause
        with open(target, "wb") as f:
            f.truncate(len(self.data))

    def run(self) -> None:
        doc = self.control_dir / protocol.FILE_WEIGHTS_ARRIVED
        with open(self.target, "r+b") as f:
            for offset in range(0, len(self.data), self.step):
                time.sleep(self.pause)
                f.seek(offset)
                f.write(self.data[offset : offset + self.step])
                f.flush()
                tmp = doc.with_suffix(".tmp")
                done = min(offset + self.step, len(self.data))
                tmp.write_text(json.dumps(arrived_document({str(self.target): done})))
                os.replace(tmp, doc)


def test_restore_complete_and_the_document() -> None:
    assert weights_arriving({protocol.RESTORE_WEIGHTS_ARRIVING: True, "podName": "p"})
    assert not weights_arriving({protocol.RESTORE_WEIGHTS_ARRIVING: "true"})
    assert not weights_arriving({"podName": "p"})
    assert not weights_arriving(None)
    doc = arrived_document({"/m/b.dsw": 8, "/m/a.dsw": 4})
    assert doc == {"version": 1, "files": {"/m/a.dsw": 4, "/m/b.dsw": 8}}
    assert parse_arrived(json.loads(json.dumps(doc))) == {"/m/a.dsw": 4, "/m/b.dsw": 8}
    for bad, message in [
        ({"version": 2, "files": {}}, "not a version 1"),
        ({"version": 1, "files": []}, "not a version 1"),
        ({"version": 1, "files": {"/m": -1}}, "bad byte count -1"),
        ({"version": 1, "files": {"/m": True}}, "bad byte count True"),
        ({"version": 1, "files": {"/m": "8"}}, "bad byte count '8'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_arrived(bad, "weights-arrived")


def test_reads_wait_for_their_bytes(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.write_bytes(os.urandom(10 * 4096))
    target = tmp_path / "model.dsw"
    feed = Arrival(source, target, tmp_path, 4096, 0.02)
    arrival = WeightsArrival(tmp_path, timeout=10)
    assert arrival.arrived(str(target)) == 0
    reader = ArrivingReader(target, False, arrival)
    feed.start()
    try:
        got = bytearray(len(feed.data))
        # The last piece first: it waits for the whole file.
        assert reader.read(memoryview(got)[6 * 4096 :], 6 * 4096) == 4 * 4096
        assert reader.read(memoryview(got)[: 6 * 4096], 0) == 6 * 4096
    finally:
        reader.close()
        feed.join()
    assert bytes(got) == feed.data
    assert arrival.waited > 0.1


def test_a_verdict_ends_every_wait_and_a_stall_times_out(tmp_path: Path) -> None:
    arrival = WeightsArrival(tmp_path, timeout=0.1)
    with pytest.raises(TimeoutError, match=r"/m/a.dsw: 0 of the 4096 bytes needed arrived within 0s"):
        arrival.wait("/m/a.dsw", 4096)
    (tmp_path / protocol.FILE_WEIGHTS_ARRIVED).write_text('{"version": 1, "files": {"/m/a.dsw": "x"}}')
    with pytest.raises(ValueError, match="bad byte count 'x'"):
        arrival.wait("/m/a.dsw", 4096)
    (tmp_path / protocol.FILE_WEIGHTS_ARRIVED).write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        arrival.wait("/m/a.dsw", 4096)
    (tmp_path / protocol.FILE_WEIGHTS_VERIFIED).write_text("{}")
    assert arrival.arrived("/m/a.dsw") is None
    assert arrival.wait("/m/a.dsw", 4096) < 0.1


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_load_that_begins_before_the_file_is_whole_gets_the_saved_bytes(
    cu: FakeDriver, tmp_path: Path, encoding: str
) -> None:
    region = make_region(cu)
    data = fill_weights(cu, region)
    region.save(tmp_path / "saved.dsw", chunk_bytes=CHUNK, encoding=encoding)
    region.release()
    target = tmp_path / "model.dsw"
    feed = Arrival(tmp_path / "saved.dsw", target, tmp_path, CHUNK, 0.01)
    arrival = WeightsArrival(tmp_path, timeout=10)
    feed.start()
    result = region.load(target, threads=4, block=CHUNK, buffers=3, arriving=arrival)
    feed.join()
    assert device_bytes(cu, region) == data
    assert not result.direct  # through the page cache the agent's writes fill
    assert arrival.waited > 0
    assert all(e.closed for e in FakeEngine.instances)


def test_a_load_of_a_file_that_stops_arriving_fails_and_leaves_the_region_mapped(
    cu: FakeDriver, tmp_path: Path
) -> None:
    region = make_region(cu)
    fill_weights(cu, region)
    region.save(tmp_path / "saved.dsw", chunk_bytes=CHUNK)
    region.release()
    target = tmp_path / "model.dsw"
    data = (tmp_path / "saved.dsw").read_bytes()
    target.write_bytes(data[: 2 * CHUNK] + bytes(len(data) - 2 * CHUNK))
    (tmp_path / protocol.FILE_WEIGHTS_ARRIVED).write_text(
        json.dumps(arrived_document({str(target): 2 * CHUNK}))
    )
    stalled = rf"{re.escape(str(target))}: {2 * CHUNK} of the [0-9]+ bytes needed arrived within 0s"
    with pytest.raises(TimeoutError, match=stalled):
        region.load(target, threads=2, block=CHUNK, buffers=2, arriving=WeightsArrival(tmp_path, timeout=0.2))
    assert all(e.closed for e in FakeEngine.instances)
    assert region.region is not None
    assert region.region.mapped
    assert cu.registered == {}
