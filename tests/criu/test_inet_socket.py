"""The cached CRIU dumps processes with inet sockets on kernels >= 6.16 (scripts/criu-so-passcred.patch).

Stock CRIU 4.1.1 fails there with "Can't get 1:16 opt: Operation not supported": the kernel refuses
SO_PASSCRED/SO_PASSSEC on anything but AF_UNIX/AF_NETLINK sockets. Every HTTP worker has such a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu
from tests.helpers.polling import wait_file

pytestmark = pytest.mark.criu

# Listens on 127.0.0.1 (TCP) and holds a UDP socket too; answers each connection with its pid.
SERVER = r"""
import os, socket, sys
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(8)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(srv.getsockname()[1]))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    conn, _ = srv.accept()
    conn.sendall(f"pid {os.getpid()}\n".encode())
    conn.close()
"""


def _ask(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return s.recv(64).decode()


async def test_listening_tcp_and_udp_sockets_dump_and_restore(criu_bin: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER,
        str(port_file),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    restored_pid = None
    try:
        port = int(await asyncio.to_thread(wait_file, port_file, 30))
        assert await asyncio.to_thread(_ask, port) == f"pid {proc.pid}\n"
        criu = Criu(criu_bin)
        await criu.dump(proc.pid, tmp_path / "images")
        assert await proc.wait() == -signal.SIGKILL
        restored = await criu.restore(tmp_path / "images", log_dir=tmp_path / "logs")
        restored_pid = restored.pid
        # The restored listener answers on the same port, from the same pid.
        assert await asyncio.to_thread(_ask, port) == f"pid {proc.pid}\n"
    finally:
        for pid in (proc.pid, restored_pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
