"""The real node's view of its pods' processes from the host (/proc), as the demo and the tests use it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from dynamo_snapshot_dev.localcluster.realnode.host import HostProcess, host_processes


def test_a_marked_process_is_found_with_its_parent() -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # The child's command line is its new one only once it has exec'd: look until it shows.
        deadline = time.monotonic() + 10
        while not (seen := host_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        (found,) = seen
        assert found.pid == proc.pid
        assert found.ppid == os.getpid()
        assert marker in found.cmdline
        assert found.cgroups  # every process has a cgroup line
    finally:
        proc.kill()
        proc.wait()
    assert host_processes(marker) == []


def test_a_pod_is_matched_by_its_uid_in_either_cgroup_spelling() -> None:
    uid = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
    cgroupfs = HostProcess(1, 0, "w", f"0::/kubepods/besteffort/pod{uid}/abc123\n")
    systemd_uid = uid.replace("-", "_")
    systemd = HostProcess(1, 0, "w", f"0::/kubepods.slice/kubepods-besteffort-pod{systemd_uid}.slice/x\n")
    other = HostProcess(1, 0, "w", "0::/kubepods/besteffort/pod0f1e2d3c-aaaa-bbbb-cccc-123456789abd/x\n")
    assert cgroupfs.in_pod(uid)
    assert systemd.in_pod(uid)
    assert not other.in_pod(uid)
    assert not HostProcess(1, 0, "w", f"0::/user.slice/pod{uid}x/\n").in_pod(uid)
