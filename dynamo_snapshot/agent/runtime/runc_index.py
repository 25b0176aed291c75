"""A pod's container found where runc keeps its state, as soon as runc has started it: before the kubelet's
next relist notices (up to a second later) and its status write reaches the agent's watch.

runc writes each container's state (the OCI annotations among its config's labels) under its root when
it creates the container, and removes the container's ``exec.fifo`` when it starts it. The annotations
the runtime sets (containerd's ``io.kubernetes.cri.*``, CRI-O's ``io.kubernetes.*``) name the pod and the
container; where a runtime passes pod annotations on, a tenant could name another pod's UID in them, so
a container counts only where its init process also lives in that pod's cgroup, which the kubelet names
after the pod's UID. The kubelet's own report of the container stays the word that binds it to the pod
(``KubeletContainers.confirm``); this only lets the work start earlier.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RuncContainer", "RuncIndex"]

_CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")
_STATE_FILE = "state.json"
_EXEC_FIFO = "exec.fifo"
_STATE_MAX = 4 << 20
# (pod UID, container name, container type) annotation keys, containerd's then CRI-O's.
_KEYS = (
    ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.cri.container-name", "io.kubernetes.cri.container-type"),
    ("io.kubernetes.pod.uid", "io.kubernetes.container.name", ""),
)
_SANDBOX_NAMES = ("POD",)  # CRI-O's pause container


@dataclass(frozen=True)
class RuncContainer:
    id: str
    pod_uid: str
    name: str
    init_pid: int


def parse_state(container_id: str, text: str) -> RuncContainer | None:
    """The pod and container a runc state file names; None for a sandbox, or one no CRI runtime made."""
    try:
        state = json.loads(text)
        labels = state["config"].get("labels") or []
        pid = int(state.get("init_process_pid") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    annotations = dict(str(label).partition("=")[::2] for label in labels)
    for uid_key, name_key, type_key in _KEYS:
        uid, name = annotations.get(uid_key, ""), annotations.get(name_key, "")
        if not (uid and name) or name in _SANDBOX_NAMES:
            continue
        if type_key and annotations.get(type_key) != "container":
            return None
        return RuncContainer(container_id, uid, name, pid)
    return None


def in_pod_cgroup(cgroup_text: str, pod_uid: str) -> bool:
    """Whether /proc/PID/cgroup text puts the process under the pod's cgroup (the cgroupfs driver's
    ``pod<uid>``, the systemd driver's ``pod<uid with _>.slice``)."""
    names = (f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}.slice")
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)[-1].split("/")
        if any(part in names or part.endswith("-" + names[1]) for part in parts):
            return True
    return False


class RuncIndex:
    """The CRI containers under a runc root, each state file read once."""

    def __init__(self, root: Path, proc: Path = Path("/proc")) -> None:
        self.root = root
        self.proc = proc
        self._known: dict[str, RuncContainer | None] = {}

    def started(self, pod_uid: str, name: str, spent: str | None = None) -> RuncContainer | None:
        """The started container ``name`` of the pod ``pod_uid`` (not ``spent``), or None yet."""
        try:
            ids = [i for i in os.listdir(self.root) if _CONTAINER_ID.fullmatch(i)]
        except OSError:
            return None
        for gone in set(self._known) - set(ids):
            del self._known[gone]
        for container_id in ids:
            if container_id not in self._known:
                text = self._read(container_id)
                if text is not None:
                    self._known[container_id] = parse_state(container_id, text)
        for found in self._known.values():
            if (
                found is not None
                and found.pod_uid == pod_uid
                and found.name == name
                and found.id != spent
                and self._running_in_pod(found)
            ):
                return found
        return None

    def _read(self, container_id: str) -> str | None:
        """The state file's text; None while runc has not written it (it renames it into place whole)."""
        try:
            fd = os.open(self.root / container_id / _STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(_STATE_MAX).decode(errors="replace")
        finally:
            os.close(fd)

    def _running_in_pod(self, found: RuncContainer) -> bool:
        if found.init_pid <= 0 or os.path.lexists(self.root / found.id / _EXEC_FIFO):
            return False  # created, not started: its entrypoint has not run yet
        try:
            cgroup = (self.proc / str(found.init_pid) / "cgroup").read_text()
        except OSError:
            return False
        return in_pod_cgroup(cgroup, found.pod_uid)
