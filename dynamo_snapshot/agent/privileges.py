"""The agent's own privileges: checked at start (the capabilities every checkpoint and restore uses, the
node's PID namespace) and before each checkpoint (what the worker holds that a restore must give back).

Without them a checkpoint or restore fails deep in CRIU's log (EPERM writing a time namespace's clock
offsets, "Unable to restore capabilities") or in runc ("stopped" for a running container whose process is
in a PID namespace the agent cannot see). The agent refuses instead and names what its pod lacks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from dynamo_snapshot.agent.runtime.base import pid_running

# linux/capability.h
CAPABILITY_BITS: dict[str, int] = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}

# Without any one of these, the checkpoint or the restore of a worker failed on the kubelet node (each
# taken away alone).
REQUIRED_CAPABILITIES: dict[str, str] = {
    "SYS_ADMIN": "namespaces and mounts: CRIU enters the worker's namespaces and rebuilds its mounts",
    "NET_ADMIN": "CRIU dumps and restores the worker's network namespace state over netlink",
    "SYS_TIME": "a restored worker gets a time namespace whose clock offsets keep its monotonic clock going",
}
# What the kernel asks of a process that acts on another user's processes: needed for workers that do not
# run as root (the agent's user). This machine's bounding set lacks SYS_RESOURCE, so no worker of another
# user can be checkpointed here at all (docs/install.md).
OTHER_USER_CAPABILITIES: dict[str, str] = {
    "SYS_RESOURCE": "CRIU reads and sets the resource limits of another user's process",
    "SYS_PTRACE": "CRIU seizes another user's processes, or any process holding a capability the agent "
    "lacks, and any process at all under Yama's ptrace_scope 1",
    "DAC_READ_SEARCH": "another user's directories, and open_by_handle_at",
}
# What a container of containerd's CRI holds unless its securityContext drops it (CRI-O's default is a
# subset). CRIU gives a restored process back every capability it held, which it can only do holding
# them itself: the agent holds every capability its workers hold, checked at each checkpoint.
CONTAINERD_DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
)


class PrivilegeError(Exception):
    """The agent's pod lacks something the agent needs; the message says what and how to grant it."""


def _status_field(status: str, name: str) -> str:
    for line in status.splitlines():
        if line.startswith(f"{name}:"):
            return line.split()[1]
    raise PrivilegeError(f"no {name} line in /proc/PID/status")


def effective_capabilities(status: str) -> int:
    """The CapEff mask of a /proc/PID/status text."""
    return int(_status_field(status, "CapEff"), 16)


def _names(mask: int) -> list[str]:
    return [name for name, bit in CAPABILITY_BITS.items() if mask >> bit & 1]


def worker_needs(pids: Iterable[int], own_status: Path = Path("/proc/self/status")) -> str | None:
    """Why the agent cannot checkpoint a worker made of ``pids`` into something it can restore, or None:
    the capabilities they hold that the agent lacks, and another user's processes without what the
    kernel asks for acting on them."""
    own_text = own_status.read_text()
    own, own_uid = effective_capabilities(own_text), int(_status_field(own_text, "Uid"))
    held, uids = 0, set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # gone: CRIU will say so
        held |= int(_status_field(text, "CapPrm"), 16)
        uids.add(int(_status_field(text, "Uid")))
    problems = []
    beyond = _names(held & ~own)
    if beyond:
        problems.append(
            f"the worker holds {', '.join(f'CAP_{n}' for n in beyond)}, which the agent lacks: CRIU gives a "
            "restored process its capabilities back and cannot give what it does not hold. Add them to "
            "the agent's capabilities (Helm value agent.capabilities) or drop them in the worker "
            "container's securityContext.capabilities"
        )
    others = sorted(uids - {own_uid})
    lacking = missing_capabilities(own, OTHER_USER_CAPABILITIES)
    if others and lacking:
        problems.append(
            f"the worker runs as uid {', '.join(map(str, others))}, not the agent's {own_uid}, and the agent "
            f"lacks {', '.join(f'CAP_{n}' for n in lacking)} ("
            + "; ".join(OTHER_USER_CAPABILITIES[n] for n in lacking)
            + ")"
        )
    return "; ".join(problems) or None


def missing_capabilities(cap_eff: int, wanted: Iterable[str] = REQUIRED_CAPABILITIES) -> list[str]:
    return [name for name in wanted if not cap_eff >> CAPABILITY_BITS[name] & 1]


def sees_host_pids(runc_root: Path) -> bool | None:
    """Whether the processes of the containers runc keeps under ``runc_root`` are this process's to see:
    true in the node's PID namespace (hostPID), false in a pod's own. None when runc keeps no running
    container there to tell by (an agent started on the host before any pod)."""
    seen = False
    for state_file in runc_root.glob("*/state.json"):
        try:
            state = json.loads(state_file.read_text())
            pid, start = int(state["init_process_pid"]), int(state["init_process_start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        seen = True
        # A pid of another namespace names another process here, or none; its start time tells them apart.
        if pid_running(pid, start):
            return True
    return False if seen else None


def check_privileges(*, runc_root: Path | None, status_path: Path = Path("/proc/self/status")) -> list[str]:
    """Raise PrivilegeError naming every required capability the agent lacks and, given the runc root of
    the kubelet's containers, whether it is outside the node's PID namespace. Returns what it lacks of
    ``OTHER_USER_CAPABILITIES``, for a warning: workers of another user than root will fail."""
    problems: list[str] = []
    cap_eff = effective_capabilities(status_path.read_text())
    missing = missing_capabilities(cap_eff)
    if missing:
        problems.append(
            "the agent lacks "
            + "; ".join(f"CAP_{name} ({REQUIRED_CAPABILITIES[name]})" for name in missing)
            + ". Its container needs at least securityContext.capabilities.add: "
            + json.dumps(list(REQUIRED_CAPABILITIES))
            + " (Helm value agent.capabilities)"
        )
    if runc_root is not None and sees_host_pids(runc_root) is False:
        problems.append(
            f"the agent does not see the processes of the containers under {runc_root}: its pod "
            "needs hostPID: true (CRIU and the CUDA checkpoint API act on other pods' processes)"
        )
    if problems:
        raise PrivilegeError("; ".join(problems))
    return missing_capabilities(cap_eff, OTHER_USER_CAPABILITIES)
