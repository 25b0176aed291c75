"""A real S3-compatible server for the tests and the demo: SeaweedFS's `weed mini` (master, volume, filer and
S3 gateway in one process), built by ``scripts/test-env.sh`` into the cache's bin directory.

It listens on loopback only, keeps its data in a work directory, and has its telemetry switched off (it is
on by default; nothing may leave the machine). The credentials are given through the environment, as
`weed` reads them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from aiobotocore.session import get_session

from dynamo_snapshot.agent.object_store import ACCESS_KEY_FILE, SECRET_KEY_FILE
from dynamo_snapshot_dev.localcluster.cluster import free_port
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError, cache_dir
from dynamo_snapshot_dev.localcluster.pki import Pki
from dynamo_snapshot_dev.localcluster.supervise import Started, die_with_parent, log_tail

__all__ = ["LocalS3", "LocalS3Error", "find_weed"]

MAX_VOLUMES = 10000
MISSING_MESSAGE = "weed (SeaweedFS) is missing: run scripts/test-env.sh"


class LocalS3Error(RuntimeError):
    """A one-line reason the S3 server could not start."""


def find_weed(binary: Path | None = None) -> Path:
    path = binary or cache_dir() / "bin" / "weed"
    if not os.access(path, os.X_OK):
        raise ComponentsMissingError(f"{MISSING_MESSAGE} (looked for {path})")
    return path


class LocalS3(Started):
    """SeaweedFS on 127.0.0.1 with its S3 API on a free port (``endpoint``), credentials
    ``access_key``/``secret_key``; ``start()`` returns once the S3 port accepts connections."""

    def __init__(
        self, workdir: Path | None = None, *, binary: Path | None = None, tls: Pki | None = None
    ) -> None:
        self.binary = find_weed(binary)
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="dsnap-s3-"))
        # With ``tls``: S3 over https on a port of its own, with the PKI's server certificate (for
        # 127.0.0.1), which clients check against the PKI's CA.
        self.tls = tls
        self.port = free_port()
        self.https_port = free_port()
        self.master_port: int | None = None  # SeaweedFS's master (its HTTP API), once started
        self.access_key = "dsnap-test"
        self.secret_key = secrets.token_hex(16)
        self._popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self.tls is not None:
            return f"https://127.0.0.1:{self.https_port}"
        return f"http://127.0.0.1:{self.port}"

    def client(self, endpoint: str | None = None) -> Any:
        """An S3 client of the server with its own credentials (``async with`` it); ``endpoint``: where
        else it is reached (a proxy in front of it)."""
        return get_session().create_client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=str(self.tls.ca_cert) if self.tls is not None else None,
        )

    async def create_bucket(self, name: str) -> None:
        async with self.client() as client:
            await client.create_bucket(Bucket=name)

    async def new_bucket(self, prefix: str = "checkpoints") -> str:
        """A bucket of its own (``prefix`` and a random suffix), created; its name."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        await self.create_bucket(name)
        return name

    def write_credentials(self, directory: Path, *, secret: str | None = None) -> Path:
        """The credentials as the agent reads them (a mounted Secret's files) in ``directory``; ``secret``
        instead of the server's, to be refused."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ACCESS_KEY_FILE).write_text(self.access_key)
        # A Secret's value may end in a newline.
        (directory / SECRET_KEY_FILE).write_text((secret or self.secret_key) + "\n")
        return directory

    @property
    def log(self) -> Path:
        return self.workdir / "weed.log"

    def start(self, timeout: float = 60.0) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        # Every port of its own (gRPC ones too: their default is the port + 10000): the defaults could be
        # taken on a shared machine.
        names = ("master", "volume", "filer")
        ports = {
            **{f"{name}.port": free_port() for name in names},
            **{f"{name}.port.grpc": free_port() for name in (*names, "s3")},
        }
        self.master_port = ports["master.port"]
        argv = [
            str(self.binary),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Each bucket is a collection with a volume of its own; by default mini allows as many volumes
            # as 1 GiB volumes fit the free disk (64 on a 67 GiB one), and a session's tests make more
            # buckets than that. Volumes are not preallocated: the cap only counts them.
            f"-volume.max={MAX_VOLUMES}",
            f"-s3.port={self.port}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        if self.tls is not None:
            argv += [
                f"-s3.port.https={self.https_port}",
                f"-s3.cert.file={self.tls.server_cert}",
                f"-s3.key.file={self.tls.server_key}",
            ]
        listening = self.https_port if self.tls is not None else self.port
        self._log = self.log.open("ab")
        self._popen = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise LocalS3Error(f"weed exited with {self._popen.returncode}: {self.log_tail()}")
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", listening)) == 0:
                    return
            time.sleep(0.2)
        self.stop()
        raise LocalS3Error(f"the S3 port {listening} did not open within {timeout:.0f}s: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: the server gone at once, as a crashed store is."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGKILL)
            self._popen.wait()

    def stop(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self._popen.terminate()
            try:
                self._popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        self._popen = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines, sep=" | ") or "(no log)"
