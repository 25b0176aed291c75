"""`ctr images import` fed from a pipe: the OCI archive of a large image goes from the host's files into
containerd's content store without ever being a file.

`ctr --local` ingests through containerd's content API and then unpacks; with `--discard-unpacked-layers`
the layer's blob may be garbage-collected once its snapshot exists, so a 15 GB image holds 15 GB of disk
once imported, not 30 (the containers run from the snapshot; nothing reads the blob again). The import's
two phases are timed apart: streaming (the archive written into the pipe, containerd hashing and storing
it as it comes) and unpacking (from the end of the stream until `ctr` returns).
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot_dev.localcluster.images import ImageBuildError, ImageRef
from dynamo_snapshot_dev.localcluster.layer_stream import (
    ImageConfig,
    LayerStream,
    StreamStats,
    write_oci_stream,
)

PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class ImportTimings:
    """Seconds of the streamed import's two phases, and what the stream carried."""

    stream_s: float
    unpack_s: float
    layer: StreamStats

    @property
    def total_s(self) -> float:
        return self.stream_s + self.unpack_s

    @property
    def stream_gbps(self) -> float:
        return self.layer.size / self.stream_s / 1e9 if self.stream_s > 0 else 0.0


def _ctr(ctr: Path, containerd_socket: Path, namespace: str) -> list[str]:
    return [str(ctr), f"--address={containerd_socket}", "-n", namespace]


def image_present(ctr: Path, containerd_socket: Path, image: ImageRef, namespace: str) -> bool:
    """Whether containerd already has `image` (by name) in `namespace`."""
    proc = subprocess.run(
        [*_ctr(ctr, containerd_socket, namespace), "images", "ls", "-q", f"name=={image.name}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageBuildError(f"ctr images ls failed: {(proc.stderr or proc.stdout).strip()}")
    return image.name in proc.stdout.split()


def import_streamed(
    ctr: Path,
    containerd_socket: Path,
    layer: LayerStream,
    image: ImageRef,
    config: ImageConfig,
    *,
    namespace: str,
    discard_layers: bool = True,
    timeout: float = 900.0,
) -> ImportTimings:
    """Write the image's OCI archive into `ctr images import --local -` and wait for the unpack."""
    argv = [*_ctr(ctr, containerd_socket, namespace), "images", "import", "--local"]
    if discard_layers:
        argv.append("--discard-unpacked-layers")
    argv.append("-")
    with tempfile.TemporaryFile() as log:
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        assert proc.stdin is not None
        fd = proc.stdin.fileno()
        with contextlib.suppress(OSError):  # a larger pipe: fewer wake-ups per gigabyte
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        failure: BaseException | None = None
        stats = StreamStats()
        try:
            stats = write_oci_stream(fd, layer, image, config)
        except BrokenPipeError as e:
            failure = e  # ctr stopped reading: its own message says why
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        streamed = time.monotonic()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise ImageBuildError(
                f"ctr images import of {image.name} did not finish in {timeout:.0f} s"
            ) from None
        finished = time.monotonic()
        log.seek(0)
        output = log.read().decode(errors="replace").strip()
    if rc != 0 or failure is not None:
        raise ImageBuildError(f"ctr images import of {image.name} failed (exit {rc}): {output[-2000:]}")
    return ImportTimings(streamed - started, finished - streamed, stats)
