"""Workers in kubelet pods: containers that containerd (or CRI-O) runs with runc, found from the pod's
``status.containerStatuses[].containerID``.

Checkpoint: CRIU dumps the container's process tree with the container's root, its network namespace
marked external and every bind and cgroup mount of the container as an external mount keyed by its path
in the container; the writable layer's diff (files the worker created, changed or deleted) and what the
restore needs to rebuild the tree (its stdio pipes, its mounts, its image) go beside the images. The
source keeps running (its Job ends it), as the kubelet owns it.

Restore goes into the restore pod's own main container, which runs in standby (a placeholder that
waits; ``dynamo_snapshot.workload.standby``): the diff is applied onto the container's root, then CRIU
runs inside the container's PID namespace (its own /proc in a private mount namespace) and cgroups,
joins its network, IPC and UTS namespaces, maps each external mount onto the restore container's own
source, and hands the placeholder's stdout/stderr pipes to the restored tree. The worker thus answers on
the restore pod's IP, lives under the pod's limits, writes to ``kubectl logs``, becomes the placeholder's
child and dies with the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.runtime.base import (
    Workload,
    WorkloadRuntimeError,
    WorkloadSpec,
    nspids,
    pid_running,
    proc_stat,
)
from dynamo_snapshot.agent.runtime.container_cgroups import (
    CgroupError,
    ContainerCgroups,
    cgroupns_args,
    container_cgroups,
    is_external_cgroup_mount,
    restore_cgroup_source,
)
from dynamo_snapshot.agent.runtime.container_gpus import container_gpus_given
from dynamo_snapshot.agent.runtime.process_tree import children, descendants, kill_descendants, restored_child
from dynamo_snapshot.agent.runtime.rootfs_diff import DIFF_FILE, RootfsDiffError, overlay_upperdir
from dynamo_snapshot.agent.runtime.uts_names import set_uts_names, uts_names
from dynamo_snapshot.agent.runtime.writable_layer import LayerWriting, capture_layer
from dynamo_snapshot.agent.sentinels import regular_present
from dynamo_snapshot.api import protocol
from dynamo_snapshot.criu import Criu, CriuError

# containerd's runc root for CRI containers (k8s.io namespace), whatever containerd's own state dir is.
CONTAINERD_RUNC_ROOT = Path("/run/containerd/runc/k8s.io")
# CRI-O's default runc root (crio.conf [crio.runtime.runtimes.runc] runtime_root).
CRIO_RUNC_ROOT = Path("/run/runc")
CONTAINER_META = "container.json"
# What a placeholder in standby writes: this SDK's file, or a Dynamo worker's restore context.
_STANDBY_FILES = (protocol.FILE_RESTORE_STANDBY, protocol.FILE_RESTORE_CONTEXT)
_CGROUP_FS = Path("/sys/fs/cgroup")
_CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")
# Moves this shell into the cgroups named before "--" (one per v1 hierarchy, the one unified dir on v2),
# then runs the rest: CRIU's restored tasks are its children and start in the container's cgroups, under
# the pod's limits. (CRIU runs with --manage-cgroups=ignore: it leaves them where they start.)
_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Container:
    """A running container as runc knows it, plus the OCI config its bundle holds."""

    id: str
    pid: int
    bundle: Path
    config: dict[str, Any]

    @property
    def rootfs(self) -> Path:
        root = Path(str((self.config.get("root") or {}).get("path") or "rootfs"))
        return root if root.is_absolute() else self.bundle / root

    @property
    def mounts(self) -> list[dict[str, Any]]:
        return [m for m in self.config.get("mounts") or [] if isinstance(m, dict)]

    @property
    def env(self) -> dict[str, str]:
        pairs = (str(e).partition("=") for e in (self.config.get("process") or {}).get("env") or [])
        return {k: v for k, _, v in pairs}

    @property
    def cgroups_path(self) -> str:
        return str((self.config.get("linux") or {}).get("cgroupsPath") or "")

    @property
    def image(self) -> str:
        return str((self.config.get("annotations") or {}).get("io.kubernetes.cri.image-name") or "")

    def bind_source(self, destination: str) -> str | None:
        for m in self.mounts:
            if m.get("destination") == destination and _is_bind(m):
                return str(m.get("source"))
        return None


@dataclass
class _Attached:
    container: Container
    image_id: str | None
    restored_pid: int | None = None
    restored_start: int | None = None
    layer_applied: bool = False
    layer: LayerWriting = field(default_factory=LayerWriting)


class ContainerdRuntime:
    """Pods' main containers on a kubelet node; ``attach`` names the container of a workload key."""

    name = "containerd"
    streams_pages = True

    def __init__(
        self,
        criu: Criu,
        state_root: Path,
        *,
        runc_root: Path = CONTAINERD_RUNC_ROOT,
        runc_binary: str = "runc",
        nsenter: str = "nsenter",
        unshare: str = "unshare",
        cgroup_root: Path = _CGROUP_FS,
    ) -> None:
        self.criu = criu
        self.state_root = state_root
        self.runc_root = runc_root
        self.runc = runc_binary
        self.nsenter = nsenter
        self.unshare = unshare
        self.cgroup_root = cgroup_root
        self._attached: dict[str, _Attached] = {}
        # Seconds of each step of the last restore per workload key (benchmarks/kubelet_restore.py).
        self.restore_phases: dict[str, dict[str, float]] = {}

    # ------------------------------------------------------------------ finding containers
    async def container(self, container_id: str) -> Container:
        """The running container with this id (containerStatuses' "containerd://<id>" or bare)."""
        runtime, sep, ident = container_id.partition("://")
        ident = ident if sep else runtime
        if not _CONTAINER_ID.fullmatch(ident):
            raise WorkloadRuntimeError(f"container id {container_id!r} is not a runc container id")
        if not self.runc_root.is_dir():
            raise WorkloadRuntimeError(
                f"container runtime state {self.runc_root} not found on this node: the agent needs the "
                "host's runc root mounted (Helm value agent.containerRuntime.runcRoot; containerd: "
                f"{CONTAINERD_RUNC_ROOT}, CRI-O: {CRIO_RUNC_ROOT})"
            )
        code, out, err = await _exec(self.runc, "--root", str(self.runc_root), "state", ident)
        if code != 0:
            raise WorkloadRuntimeError(
                f"container {ident[:12]} not found under {self.runc_root}: {(err or out).strip()}"
            )
        try:
            state = json.loads(out)
            bundle = Path(state["bundle"])
            config = json.loads(await asyncio.to_thread((bundle / "config.json").read_text))
        except (ValueError, KeyError, OSError) as e:
            raise WorkloadRuntimeError(
                f"container {ident[:12]}: unreadable runc state or bundle: {e}"
            ) from None
        if state.get("status") != "running" or int(state.get("pid") or 0) <= 0:
            raise WorkloadRuntimeError(f"container {ident[:12]} is {state.get('status')}, not running")
        return Container(ident, int(state["pid"]), bundle, config)

    async def attach(self, key: str, container_id: str, *, image_id: str | None = None) -> Workload:
        """Take the running container ``container_id`` as workload ``key`` (a checkpoint source, or a
        restore target in standby)."""
        container = await self.container(container_id)
        previous = self._attached.get(key)
        attached = _Attached(container, image_id)
        if previous is not None and previous.container.id == container.id:
            attached.restored_pid, attached.restored_start = previous.restored_pid, previous.restored_start
        self._attached[key] = attached
        if attached.restored_pid is None:
            attached.restored_pid = restored_child(container.pid)
        return self._workload(key, attached)

    def _workload(self, key: str, attached: _Attached) -> Workload:
        c = attached.container
        pid = attached.restored_pid or c.pid
        return Workload(
            key,
            pid,
            self.control_dir(key),
            container_id=c.id,
            worker_control_dir=_control_mount(c),
            image_id=attached.image_id,
            visible_gpus=container_gpus_given(c.env, c.config),
        )

    def _get(self, key: str) -> _Attached:
        attached = self._attached.get(key)
        if attached is None:
            raise WorkloadRuntimeError(f"no container attached for {key}")
        return attached

    def control_dir(self, key: str) -> Path:
        c = self._get(key).container
        source = c.bind_source(_control_mount(c))
        if source is None:
            raise WorkloadRuntimeError(
                f"container {c.id[:12]} has no snapshot control volume at {_control_mount(c)}"
            )
        return Path(source)

    def forget(self, key: str) -> None:
        """Drop what is known of ``key``'s container (its pod is gone), stopping nothing."""
        self._attached.pop(key, None)
        self.restore_phases.pop(key, None)

    def holds_restored(self, key: str) -> bool:
        """Whether a restore put processes into the attached container."""
        attached = self._attached.get(key)
        return attached is not None and attached.restored_pid is not None

    def container_pid(self, key: str) -> int:
        """The host pid of the attached container's first process (its placeholder, before a restore)."""
        return self._get(key).container.pid

    def container_env(self, key: str) -> dict[str, str]:
        """The environment the attached container's process started with."""
        return self._get(key).container.env

    def standby(self, key: str) -> bool:
        """Whether the attached container's placeholder says it waits for the restore: this SDK's
        standby file, or the restore context a Dynamo worker's standby writes."""
        ctl = self.control_dir(key)
        return any(regular_present(ctl / name) for name in _STANDBY_FILES)

    async def launch(self, spec: WorkloadSpec) -> Workload:
        raise WorkloadRuntimeError("the kubelet starts containers on this node; the agent launches none")

    async def find(self, key: str) -> Workload | None:
        attached = self._attached.get(key)
        if attached is None or not pid_running(attached.container.pid):
            return None
        if attached.restored_pid is not None and not pid_running(
            attached.restored_pid, attached.restored_start
        ):
            return None
        return self._workload(key, attached)

    async def stop(self, key: str) -> None:
        """Kill what a restore put into the container (the placeholder then exits and the kubelet sees
        the container end); a checkpoint source is the kubelet's to stop."""
        attached = self._attached.get(key)
        if attached is not None:
            await attached.layer.abandon()
        if attached is None or attached.restored_pid is None:
            return
        # The placeholder exits with its restored tree; the one the kubelet starts next says anew that
        # it waits.
        with contextlib.suppress(WorkloadRuntimeError, OSError):
            for name in _STANDBY_FILES:
                (self.control_dir(key) / name).unlink(missing_ok=True)
        del self._attached[key]
        kill_descendants(attached.container.pid)

    def tool_files(self) -> list[Path]:
        found = (shutil.which(t) for t in (self.runc, "sh", self.nsenter, self.unshare))
        return [Path(p) for p in found if p]

    # ------------------------------------------------------------------ checkpoint
    async def dump(self, workload: Workload, images_dir: Path) -> float:
        c = self._get(workload.key).container
        started = time.monotonic()
        try:
            mountinfo = await asyncio.to_thread(Path(f"/proc/{c.pid}/mountinfo").read_text)
        except OSError as e:
            raise WorkloadRuntimeError(f"container {c.id[:12]} is gone: {e}") from None
        external = _external_mounts(c, mountinfo)
        meta: dict[str, Any] = {
            "id": c.id,
            "image": c.image,
            "imageID": workload.image_id,
            "stdio": [_fd_target(c.pid, n) for n in range(3)],
            "externalMounts": sorted(external),
            "controlDir": _control_mount(c),
        }
        upper = overlay_upperdir(mountinfo)
        if upper is None:
            raise WorkloadRuntimeError(
                f"container {c.id[:12]}'s root is not an overlay with a writable layer: its changes "
                "cannot be carried (containerd's overlayfs snapshotter is needed)"
            )
        try:
            meta["rootfsDiff"] = await capture_layer(
                upper,
                images_dir / DIFF_FILE,
                lambda: [c.pid, *descendants(c.pid)],
                [m["destination"] for m in c.mounts],
            )
        except (RootfsDiffError, OSError) as e:
            raise WorkloadRuntimeError(f"writable layer of container {c.id[:12]}: {e}") from None
        await asyncio.to_thread((images_dir / CONTAINER_META).write_text, json.dumps(meta, indent=1))
        args = ["--root", str(c.rootfs), "--external", f"net[{_ns_inode(c.pid, 'net')}]:extNetNs"]
        for dest in sorted(external):
            args += ["--ext-mount-map", f"{dest}:{dest}"]
        work = self._work_dir(workload.key, "dump")
        try:
            await self.criu.dump(
                c.pid,
                images_dir,
                log_dir=work,
                leave_running=True,
                extra_args=[*args, "--network-lock", "skip"],
            )
        except CriuError as e:
            raise WorkloadRuntimeError(str(e)) from None
        return time.monotonic() - started

    # ------------------------------------------------------------------ restore
    def restore_target(self, key: str) -> Workload | None:
        attached = self._attached.get(key)
        if attached is None or attached.restored_pid is not None:
            return None
        return self._workload(key, attached)

    async def prepare_restore(self, key: str, images_dir: Path) -> None:
        """The checkpointed container's writable layer onto the restore container's root filesystem:
        what CRIU opens now, the rest beside CRIU until ``finish_restore``."""
        attached = self._get(key)
        target = attached.container
        if not pid_running(target.pid):
            raise WorkloadRuntimeError(f"restore container {target.id[:12]} stopped before the restore")
        await attached.layer.begin(
            images_dir / DIFF_FILE, target.rootfs, [m["destination"] for m in target.mounts]
        )
        attached.layer_applied = True

    async def finish_restore(self, key: str) -> float | None:
        """The writable layer's files written beside CRIU, once all are: seconds they took, None where
        the whole layer went before CRIU."""
        attached = self._attached.get(key)
        return None if attached is None else await attached.layer.finish()

    async def restore(
        self, key: str, images_dir: Path, source_control_dir: str | None, *, criu: Criu | None = None
    ) -> Workload:
        attached = self._get(key)
        try:
            return await self._restore(key, attached, images_dir, source_control_dir, criu or self.criu)
        except BaseException:
            await attached.layer.abandon()
            raise

    async def _restore(
        self, key: str, attached: _Attached, images_dir: Path, source_control_dir: str | None, criu: Criu
    ) -> Workload:
        if not attached.layer_applied:
            await self.prepare_restore(key, images_dir)
        target = attached.container
        if not pid_running(target.pid):
            raise WorkloadRuntimeError(f"restore container {target.id[:12]} stopped before the restore")
        try:
            meta = json.loads(await asyncio.to_thread((images_dir / CONTAINER_META).read_text))
        except (OSError, ValueError) as e:
            raise WorkloadRuntimeError(f"checkpoint lacks its container description: {e}") from None
        cgroups = await asyncio.to_thread(self._cgroups, target)
        external = [str(d) for d in meta.get("externalMounts") or []]
        mounts = _restore_mounts(target, external, cgroups, self.cgroup_root)
        phases = self.restore_phases[key] = {}
        # CRIU writes the checkpointed host and domain names into the UTS namespace it joins: the
        # pod's, which must keep its own.
        names = await asyncio.to_thread(uts_names, target.pid)
        started = time.monotonic()
        fds: list[int] = []
        restored = False
        try:
            args = self._restore_args(target, meta, mounts, fds)
            procs = [str(d / "cgroup.procs") for d in cgroups.dirs]
            own_ns = _ns_inode(os.getpid(), "cgroup")
            cgroupns = cgroupns_args(target.pid, _ns_inode(target.pid, "cgroup"), own_ns)
            work = self._work_dir(key, "restore")
            wrapper = [
                "/bin/sh", "-c", _JOIN_CGROUPS, "join-cgroups", *procs, "--",
                self.nsenter, *cgroupns, f"--pid=/proc/{target.pid}/ns/pid", "--",
                self.unshare, "--mount", "--propagation", "private", "--mount-proc",
            ]  # fmt: skip
            try:
                result = await criu.restore(
                    images_dir, log_dir=work, extra_args=args, wrapper=wrapper, pass_fds=fds
                )
                restored = True
            except CriuError as e:
                # CRIU kills what it restored when it fails; whatever it could not, goes too (the
                # placeholder itself starts no process).
                kill_descendants(target.pid)
                raise WorkloadRuntimeError(_explain(str(e))) from None
        finally:
            for fd in fds:
                os.close(fd)
            # Also after a failed restore: CRIU sets the names before it fails on, say, a socket. A
            # restored worker must not keep the checkpoint pod's name (its /etc/hosts has only its own:
            # a lookup of the old one waits on DNS), so after a restore a failure here fails it.
            try:
                await asyncio.to_thread(set_uts_names, target.pid, *names)
            except WorkloadRuntimeError:
                if restored:
                    raise
        phases["criu"] = time.monotonic() - started
        host_pid = await _host_pid(target.pid, result.pid)
        if host_pid is None:
            raise WorkloadRuntimeError(
                f"CRIU restored pid {result.pid} but it is not a process of container {target.id[:12]}"
            )
        attached.restored_pid = host_pid
        attached.restored_start = _start_time(host_pid)
        return self._workload(key, attached)

    def _restore_args(
        self, target: Container, meta: dict[str, Any], mounts: dict[str, str], fds: list[int]
    ) -> list[str]:
        def inherit(path: str, flags: int) -> int:
            # Non-blocking: the placeholder is the tenant's process, and a FIFO it put where its pipe
            # was would block an open for writing until someone reads it. Blocking again once open, as
            # the restored worker had its pipes.
            try:
                fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as e:
                raise WorkloadRuntimeError(
                    f"restore container {target.id[:12]}: {path}: {e.strerror}"
                ) from None
            os.set_blocking(fd, True)
            fds.append(fd)
            return fd

        # CRIU's older mount engine: the newer one (mount-v2) copies each mount's sharing from its source
        # with MOVE_MOUNT_SET_GROUP, which fails (EINVAL) for a container's mounts that are slaves of the
        # host's shared ones (its cgroup mounts on a host whose /sys/fs/cgroup is shared, as systemd's).
        args = ["--root", str(target.rootfs), "--manage-cgroups=ignore", "--mntns-compat-mode"]
        args += ["--inherit-fd", f"fd[{inherit(f'/proc/{target.pid}/ns/net', os.O_RDONLY)}]:extNetNs"]
        for ns in ("uts", "ipc"):
            args += ["--join-ns", f"{ns}:/proc/self/fd/{inherit(f'/proc/{target.pid}/ns/{ns}', os.O_RDONLY)}"]
        # The placeholder's stdout/stderr are the pipes the runtime reads into the container's log.
        stdio = [str(s) for s in meta.get("stdio") or []]
        for n, source in enumerate(stdio[:3]):
            if source.startswith("pipe:") and _fd_target(target.pid, n).startswith("pipe:"):
                fd = inherit(f"/proc/{target.pid}/fd/{n}", os.O_RDONLY if n == 0 else os.O_WRONLY)
                args += ["--inherit-fd", f"fd[{fd}]:{source}"]
        for dest, source in sorted(mounts.items()):
            args += ["--ext-mount-map", f"{dest}:{source}"]
        return args

    def _cgroups(self, target: Container) -> ContainerCgroups:
        """The restore container's cgroups, from its placeholder's /proc/<pid>/cgroup as this agent's
        mounts show them."""
        try:
            own = Path(f"/proc/{target.pid}/cgroup").read_text()
            return container_cgroups(own, Path("/proc/self/mountinfo").read_text(), self.cgroup_root)
        except OSError as e:
            raise WorkloadRuntimeError(f"restore container {target.id[:12]} is gone: {e}") from None
        except CgroupError as e:
            raise WorkloadRuntimeError(
                f"cgroup {target.cgroups_path} of container {target.id[:12]}: {e}"
            ) from None

    def _work_dir(self, key: str, op: str) -> Path:
        work = self.state_root / key / op
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        return work


# ---------------------------------------------------------------------- helpers
def _is_bind(m: dict[str, Any]) -> bool:
    """An OCI mount of host content: type bind, or a bind/rbind option (runtimes write either)."""
    kinds = {str(m.get("type") or ""), *(str(o) for o in m.get("options") or [])}
    return bool(kinds & {"bind", "rbind"})


def _control_mount(c: Container) -> str:
    return next((c.env[n] for n in protocol.ENV_CONTROL_DIRS if c.env.get(n)), protocol.CONTROL_MOUNT_PATH)


def _external_mounts(c: Container, mountinfo: str) -> set[str]:
    """The container's mounts whose content lives outside it: binds (hosts, resolv.conf, volumes, the
    control dir, /dev/shm, the service-account token) and its cgroup mounts (v1: binds of the host's
    hierarchies; v2: its cgroup2 mount at /sys/fs/cgroup)."""
    out = {str(m["destination"]) for m in c.mounts if _is_bind(m)}
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        if is_external_cgroup_mount(head.split()[4], tail.split(" ", 1)[0]):
            out.add(head.split()[4])
    return out


def _restore_mounts(
    target: Container, external: list[str], cgroups: ContainerCgroups, cgroup_root: Path
) -> dict[str, str]:
    """Each of the checkpoint's external mounts -> the restore container's own source for it."""
    out: dict[str, str] = {}
    missing: list[str] = []
    for dest in external:
        try:
            cgroup = restore_cgroup_source(dest, cgroups, cgroup_root, target.cgroups_path)
        except CgroupError as e:
            raise WorkloadRuntimeError(f"restore container {target.id[:12]}: {e}") from None
        if cgroup is not None:
            out[dest] = cgroup
            continue
        source = target.bind_source(dest)
        if source is None:
            missing.append(dest)
        else:
            out[dest] = source
    if missing:
        raise WorkloadRuntimeError(
            "the restore container lacks mounts the checkpoint had: " + ", ".join(sorted(missing))
        )
    return out


def _fd_target(pid: int, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _ns_inode(pid: int, ns: str) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/{ns}").st_ino
    except OSError as e:
        raise WorkloadRuntimeError(f"process {pid} is gone: {e}") from None


async def _host_pid(placeholder: int, ns_pid: int, within: float = 2.0) -> int | None:
    """The host pid of the restored root that CRIU reported as ``ns_pid`` in the container's PID
    namespace; CRIU's exit hands it to the placeholder, so it is looked for among its children."""
    deadline = time.monotonic() + within
    while True:
        for child in children(placeholder):
            ids = nspids(child)
            if len(ids) >= 2 and ids[1] == ns_pid:
                return child
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.01)


def _start_time(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat.start_time if stat is not None else None


def _explain(message: str) -> str:
    if "Cannot assign requested address" in message or "EADDRNOTAVAIL" in message:
        return (
            f"{message} (a socket of the checkpointed worker is bound to its old pod IP; workers must "
            "listen on 0.0.0.0 or open their listeners after the restore)"
        )
    return message


async def _exec(*argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr apart: runc warns on stderr even when it answers JSON on stdout."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as e:
        raise WorkloadRuntimeError(f"cannot run {argv[0]}: {e}") from None
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
