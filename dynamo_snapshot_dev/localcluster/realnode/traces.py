"""What a real node leaves on the host, found and removed: processes, mounts, cgroups, runc state, shim
sockets, the bridge, iptables chains, CNI results and log links.

Both cgroup versions: the `kubepods` tree at the root of every v1 hierarchy, or of the one v2 hierarchy.
Neither the `ip` nor the iptables commands are needed: the bridge goes through the kernel's ioctls
(`links`), and iptables chains are looked for only where iptables is installed.

A stop removes them all; a start after a killed run removes what that run left. Only this node's traces
are touched: they are recognised by its state dir, its containerd socket and its network's name.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shlex
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot_dev.localcluster.realnode import links
from dynamo_snapshot_dev.localcluster.realnode.host import (
    CGROUP_ROOT,
    CGROUP_SHARED_MARK,
    CNI_NETWORK,
    CNI_RESULTS,
    CONTAINER_LOG_LINKS,
    CONTAINERD_NAMESPACE,
    DEVICE_PLUGIN_SOCKET,
    KUBE_PROXY_CHAINS,
    KUBELET_CHAINS,
    KUBELET_DEVICE_PLUGINS,
    RUNC,
    RUNC_ROOT,
    SHIM_SOCKETS,
    SYSTEM_CONTAINERD,
    run,
    wait_until,
)

_MNT_DETACH = 2


@dataclass(frozen=True)
class HostTraces:
    """The traces of the node rooted at `workdir` and `state_dir`, with containerd at `containerd_socket`
    and its pods on `bridge`."""

    workdir: Path
    state_dir: Path
    containerd_socket: Path
    bridge: str
    runc: Path = RUNC

    def found(self) -> list[str]:
        """Node traces on the host now (none after a clean stop): mounts, cgroups, shims, bridge, chains."""
        found = [f"mount {m}" for m in self.mounts()]
        found += [f"cgroup {c}" for c in kubepods_cgroups()]
        found += [f"process {pid} ({cmdline(pid)[:80]})" for pid in self.pids()]
        if links.exists(self.bridge):
            found.append(f"bridge {self.bridge}")
        found += [f"iptables {c}" for c in iptables_chains(KUBELET_CHAINS + KUBE_PROXY_CHAINS)]
        if self.state_dir.exists():
            found.append(f"dir {self.state_dir}")
        if CNI_RESULTS.is_dir():
            found += [
                f"CNI result {f}" for f in CNI_RESULTS.iterdir() if f.name.startswith(f"{CNI_NETWORK}-")
            ]
        containers = self.runc_containers()
        found += [f"runc state {RUNC_ROOT / c}" for c in containers]
        found += [f"shim socket {p}" for p in self.shim_sockets(containers)]
        for sock in (KUBELET_DEVICE_PLUGINS / "kubelet.sock", DEVICE_PLUGIN_SOCKET):
            if sock.exists():
                found.append(f"socket {sock}")
        if CGROUP_SHARED_MARK.exists():
            found.append(f"{CGROUP_ROOT} made a shared mount")
        return found

    def share(self) -> None:
        """Make the node's directories that the chart's agent mounts with HostToContainer propagation
        (its runtimeHostPaths) shared mounts, as they are on a systemd host: the kubelet refuses that
        propagation from a private mount, and only through a shared one does the agent see the rootfs and
        volumes of containers started after it. Before containerd starts, so theirs propagate."""
        for d in (self.workdir, self.state_dir, RUNC_ROOT):
            d.mkdir(parents=True, exist_ok=True)
            if str(d) not in mountpoints():
                run(["mount", "--bind", str(d), str(d)])
            run(["mount", "--make-rshared", str(d)])
        if propagation(str(CGROUP_ROOT)) == "private":
            CGROUP_SHARED_MARK.touch()
            run(["mount", "--make-rshared", str(CGROUP_ROOT)])

    def remove(self, errors: list[str], extra_workdirs: set[Path] | None = None) -> None:
        """Remove every trace; what cannot be removed is added to `errors`. `extra_workdirs` replace
        `workdir` as roots (a killed run's workdir, from its record, besides this one's)."""
        roots = {self.state_dir, RUNC_ROOT, *(extra_workdirs or {self.workdir})}
        # runc's state of our containers lives outside our dirs; `runc delete --force` also kills them.
        containers = self.runc_containers()
        for cid in containers:
            run([str(self.runc), "--root", str(RUNC_ROOT), "delete", "--force", cid], check=False)
            shutil.rmtree(RUNC_ROOT / cid, ignore_errors=True)
        for sock in self.shim_sockets(containers):
            sock.unlink(missing_ok=True)
        # Container processes next (a killed run's pods keep running under their shims), then the shims.
        for cg in kubepods_cgroups():
            for pid in cgroup_pids(cg):
                kill(pid, signal.SIGKILL)
        for pid in self.pids():
            kill(pid, signal.SIGKILL)
        wait_until(lambda: not self.pids() and not any(cgroup_pids(c) for c in kubepods_cgroups()), 10)
        for mount in self.mounts(roots):
            if not umount(mount):
                errors.append(f"umount {mount} failed")
        for cg in kubepods_cgroups():
            with contextlib.suppress(FileNotFoundError):
                try:
                    cg.rmdir()
                except OSError as e:
                    errors.append(f"rmdir {cg}: {e.strerror}")
        remove_iptables_chains(KUBELET_CHAINS + KUBE_PROXY_CHAINS)
        try:
            links.delete_bridge(self.bridge)
        except links.LinkError as e:
            errors.append(str(e))
        if CGROUP_SHARED_MARK.exists():
            proc = run(["mount", "--make-rprivate", str(CGROUP_ROOT)], check=False)
            if proc.returncode != 0:
                errors.append(f"mount --make-rprivate {CGROUP_ROOT}: {proc.stderr.strip()}")
            else:
                CGROUP_SHARED_MARK.unlink()
        remove_container_log_links(roots)
        tidy_shared_dirs()
        if not self.mounts(roots):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def mounts(self, roots: set[Path] | None = None) -> list[str]:
        prefixes = [str(r).rstrip("/") + "/" for r in (roots or {self.state_dir, RUNC_ROOT, self.workdir})]
        found = [m for m in mountpoints() if any((m + "/").startswith(p) for p in prefixes)]
        # Deepest first: an overlay rootfs inside the kubelet root's own bind mount goes before it.
        return sorted(set(found), key=lambda m: (-m.count("/"), m))

    def runc_containers(self) -> list[str]:
        """Containers in the runc root whose bundle is in this node's containerd state dir."""
        prefix = f"bundle={self.state_dir}/"
        found: list[str] = []
        if not RUNC_ROOT.is_dir():
            return found
        for state in RUNC_ROOT.glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                labels = json.loads(state.read_text())["config"].get("labels") or []
                if any(str(label).startswith(prefix) for label in labels):
                    found.append(state.parent.name)
        return found

    def shim_sockets(self, containers: list[str]) -> list[Path]:
        """The shims' sockets in /run/containerd/s: named sha256(<containerd address>/<namespace>/<id>)."""
        tasks = self.state_dir / "io.containerd.runtime.v2.task" / CONTAINERD_NAMESPACE
        ids = set(containers) | ({d.name for d in tasks.iterdir()} if tasks.is_dir() else set())
        names = {
            hashlib.sha256(f"{self.containerd_socket}/{CONTAINERD_NAMESPACE}/{i}".encode()).hexdigest()
            for i in ids
        }
        return [SHIM_SOCKETS / n for n in sorted(names) if (SHIM_SOCKETS / n).exists()]

    def pids(self) -> list[int]:
        """Shims (and anything else) started with this node's containerd socket or state dir."""
        needles = (str(self.containerd_socket), str(self.state_dir) + "/")
        return [pid for pid in all_pids() if pid != os.getpid() and any(n in cmdline(pid) for n in needles)]


def all_pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def cgroup_hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """Where the cgroup hierarchies are: ``root`` itself on cgroup v2 (the unified hierarchy is mounted
    there, with its cgroup.controllers), else each v1 hierarchy (and a hybrid's unified) below it."""
    if (root / "cgroup.controllers").is_file():
        return [root]
    if not root.is_dir():
        return []
    return [h for h in sorted(root.iterdir()) if h.is_dir() and not h.is_symlink()]


def kubepods_cgroups(root: Path = CGROUP_ROOT) -> list[Path]:
    """Every kubepods cgroup dir in every hierarchy, deepest first."""
    found: list[Path] = []
    for hierarchy in cgroup_hierarchies(root):
        top = hierarchy / "kubepods"
        if top.is_dir() and not top.is_symlink():
            for dirpath, _dirs, _files in os.walk(top):
                found.append(Path(dirpath))
    return sorted(set(found), key=lambda p: (-len(p.parts), str(p)))


def cgroup_pids(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def mountpoints() -> list[str]:
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            # mountinfo escapes space, tab, newline and backslash as octal.
            points.append(fields[4].encode().decode("unicode_escape"))
    return points


def propagation(path: str, mountinfo: str | None = None) -> str:
    """shared, slave or private: how the mount at ``path`` (or the one it lies in) propagates, as
    ``mountinfo`` (default: this process's) shows it. On cgroup v2 /sys/fs/cgroup is a mount of its own,
    on v1 the tmpfs that holds the hierarchies: either way the one at that path."""
    best, how = "", "private"
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    for line in text.splitlines():
        fields = line.split(" ")
        point = fields[4].encode().decode("unicode_escape")
        if (path + "/").startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            optional = fields[6 : fields.index("-")]
            best = point
            how = next(
                (
                    k
                    for k, tag in (("shared", "shared:"), ("slave", "master:"))
                    if any(o.startswith(tag) for o in optional)
                ),
                "private",
            )
    return how


def umount(path: str) -> bool:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for _ in range(5):
        if path not in mountpoints():
            return True
        libc.umount2(path.encode(), _MNT_DETACH)
    return path not in mountpoints()


def iptables_chains(chains: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for family in ("iptables", "ip6tables"):
        save = shutil.which(f"{family}-save")
        if save is None:
            continue
        out = run([save], check=False, timeout=30).stdout
        table = ""
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and line[1:].split(" ")[0] in chains:
                found.append(f"{family} -t {table} {line[1:].split(' ')[0]}")
    return found


def remove_iptables_chains(chains: tuple[str, ...]) -> None:
    """Delete `chains` and every rule that jumps to them, in filter/nat/mangle, for IPv4 and IPv6."""
    for family in ("iptables", "ip6tables"):
        tool, save = shutil.which(family), shutil.which(f"{family}-save")
        if tool is None or save is None:
            continue
        out = run([save], check=False, timeout=30).stdout
        table = ""
        jumps: list[tuple[str, list[str]]] = []
        present: list[tuple[str, str]] = []
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                name = line[1:].split(" ")[0]
                if name in chains:
                    present.append((table, name))
            elif line.startswith("-A "):
                args = shlex.split(line)
                target = args[args.index("-j") + 1] if "-j" in args else ""
                if target in chains and args[1] not in chains:
                    jumps.append((table, ["-D", *args[1:]]))
        for table, rule in jumps:
            run([tool, "-w", "-t", table, *rule], check=False)
        for table, name in present:
            run([tool, "-w", "-t", table, "-F", name], check=False)
        for table, name in present:
            run([tool, "-w", "-t", table, "-X", name], check=False)


def remove_container_log_links(roots: set[Path]) -> None:
    """The kubelet links /var/log/containers/*.log to its pod logs whatever podLogsDir is; drop ours."""
    links = CONTAINER_LOG_LINKS
    if not links.is_dir():
        return
    prefixes = tuple(str(r).rstrip("/") + "/" for r in roots)
    for link in links.iterdir():
        if link.is_symlink() and os.readlink(link).startswith(prefixes):
            link.unlink(missing_ok=True)


def tidy_shared_dirs() -> None:
    # libcni caches one result per sandbox and interface; sandboxes removed without a CNI DEL (a killed
    # run, a stop that outran the kubelet) leave theirs. Ours are named after our network and sandbox ids.
    if CNI_RESULTS.is_dir():
        ours = [f for f in CNI_RESULTS.iterdir() if f.name.startswith(f"{CNI_NETWORK}-")]
        sandbox_ids = {f.name.removeprefix(f"{CNI_NETWORK}-").rsplit("-", 1)[0] for f in ours}
        ours += [f for f in CNI_RESULTS.iterdir() if f.name.startswith("cni-loopback-")
                 and f.name.removeprefix("cni-loopback-").rsplit("-", 1)[0] in sandbox_ids]  # fmt: skip
        for f in ours:
            f.unlink(missing_ok=True)
    (KUBELET_DEVICE_PLUGINS / "kubelet.sock").unlink(missing_ok=True)
    DEVICE_PLUGIN_SOCKET.unlink(missing_ok=True)
    empty_ok = [CNI_RESULTS, CNI_RESULTS.parent, KUBELET_DEVICE_PLUGINS, KUBELET_DEVICE_PLUGINS.parent]
    empty_ok.append(CONTAINER_LOG_LINKS)
    # The shim's socket dir and runc root under /run/containerd, unless a containerd of the system runs.
    if not (SYSTEM_CONTAINERD / "containerd.sock").exists():
        empty_ok += [RUNC_ROOT, RUNC_ROOT.parent, SHIM_SOCKETS, SYSTEM_CONTAINERD]
    for d in empty_ok:
        with contextlib.suppress(OSError):
            d.rmdir()
