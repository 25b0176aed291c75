"""Workers as runc containers: own pid, mount, ipc and uts namespaces, the pod's control dir bind-mounted at
/snapshot-control. Checkpoint is `runc checkpoint` (CRIU underneath), restore is `runc restore` into a
new container whose bundle binds the *new* pod's control dir — so any number of replicas can be restored
from one checkpoint on one host, each with its own control dir and identity.

On a real node containerd/CRI-O created the container: `find` then only needs the container's runc root
and id (from the pod's containerStatuses) — the rest is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.runtime.base import Workload, WorkloadRuntimeError, WorkloadSpec, worker_env
from dynamo_snapshot.api import protocol
from dynamo_snapshot.criu import Criu

# Host directories a container the agent launches itself (local mode) sees read-only: the system's
# programs and libraries. Where the worker's interpreter or code lives elsewhere, add it (`hostBinds`).
DEFAULT_HOST_BINDS = ("/usr", "/etc", "/opt")
_MERGED_USR = ("bin", "lib", "lib64", "sbin")


class RuncRuntime:
    name = "runc"
    # runc runs CRIU itself.
    streams_pages = False

    def __init__(
        self,
        state_root: Path,
        control_root: Path,
        *,
        criu_binary: Path,
        runc_binary: str = "runc",
        host_binds: Sequence[str] = DEFAULT_HOST_BINDS,
        writable_binds: Sequence[str] = (),
    ) -> None:
        self.state_root = state_root  # bundles live here; runc's own state under state_root/runc
        self.control_root = control_root
        self.criu_binary = criu_binary
        self.runc = runc_binary
        self.host_binds = _outermost([os.path.realpath(b) for b in host_binds if os.path.isdir(b)])
        # Read-write host directories (say, where workers register themselves); outside the read-only
        # binds, as CRIU does not restore a bind nested in another.
        self.writable_binds = [os.path.realpath(b) for b in writable_binds]
        for w in self.writable_binds:
            if any(w == b or w.startswith(b.rstrip("/") + "/") for b in self.host_binds):
                raise ValueError(f"writable bind {w} lies inside a read-only bind")

    def control_dir(self, key: str) -> Path:
        return self.control_root / key

    def tool_files(self) -> list[Path]:
        found = shutil.which(self.runc)
        return [Path(found)] if found else []

    def _bundle(self, key: str) -> Path:
        return self.state_root / "bundles" / key

    async def _runc(self, *args: str, check: bool = True) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            self.runc,
            "--root",
            str(self.state_root / "runc"),
            "--criu",
            str(self.criu_binary),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            # Apart: runc logs warnings (a deprecation, a cgroup note) on stderr even when it succeeds,
            # and `state` answers JSON on stdout.
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        text = out.decode(errors="replace").strip()
        rc = proc.returncode or 0
        if check and rc != 0:
            said = "\n".join(t for t in (text, err.decode(errors="replace").strip()) if t)
            raise WorkloadRuntimeError(f"runc {args[0]} failed ({rc}): {_last_lines(said)}")
        return rc, text

    def _write_bundle(self, key: str, spec: WorkloadSpec | None, template: dict[str, Any] | None) -> Path:
        bundle = self._bundle(key)
        if bundle.exists():
            shutil.rmtree(bundle)
        rootfs = bundle / "rootfs"
        rootfs.mkdir(parents=True)
        # Debian/Ubuntu merge /bin, /lib... into /usr: links, not bind mounts (CRIU cannot re-bind symlinks).
        for name in _MERGED_USR:
            if os.path.islink(f"/{name}"):
                (rootfs / name).symlink_to(os.readlink(f"/{name}"))
        ctl = self.control_dir(key)
        ctl.mkdir(parents=True, exist_ok=True)
        config = template if template is not None else self._config(spec)
        for m in config["mounts"]:
            if m["destination"] == protocol.CONTROL_MOUNT_PATH:
                m["source"] = str(ctl)
        config["root"]["path"] = str(rootfs)
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    def _config(self, spec: WorkloadSpec | None) -> dict[str, Any]:
        assert spec is not None
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/root",
            **worker_env(spec, protocol.CONTROL_MOUNT_PATH),
        }
        # stdout/stderr go to the container's own /tmp (a tmpfs CRIU carries along): a host file would be
        # an fd CRIU cannot place in the container's mount namespace.
        shell = 'exec "$@" >>/tmp/worker.log 2>&1'
        mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "nodev", "mode=1777"],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777"],
            },
            {
                "destination": protocol.CONTROL_MOUNT_PATH,
                "type": "bind",
                "source": "",
                "options": ["rbind", "rw"],
            },
        ]
        mounts += [
            {"destination": b, "type": "bind", "source": b, "options": ["rbind", "ro"]}
            for b in self.host_binds
        ]
        mounts += [
            {"destination": b, "type": "bind", "source": b, "options": ["rbind", "rw"]}
            for b in self.writable_binds
        ]
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": ["/bin/sh", "-c", shell, "sh", *spec.command],
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": spec.workdir or "/",
                "noNewPrivileges": True,
            },
            "root": {"path": "", "readonly": True},
            "hostname": spec.key[:63],
            "mounts": mounts,
            "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]},
        }

    async def launch(self, spec: WorkloadSpec) -> Workload:
        bundle = self._write_bundle(spec.key, spec, None)
        await self._runc("run", "-d", "--bundle", str(bundle), spec.key)
        found = await self.find(spec.key)
        if found is None:
            raise WorkloadRuntimeError(f"container {spec.key} exited right after start")
        return found

    async def find(self, key: str) -> Workload | None:
        rc, out = await self._runc("state", key, check=False)
        if rc != 0:
            return None
        state = json.loads(out)
        if state.get("status") not in ("running", "created", "paused"):
            return None
        return Workload(key, int(state["pid"]), self.control_dir(key), container_id=key)

    async def stop(self, key: str) -> None:
        await self._runc("kill", key, "KILL", check=False)
        await self._runc("delete", "-f", key, check=False)
        shutil.rmtree(self._bundle(key), ignore_errors=True)
        shutil.rmtree(self.control_dir(key), ignore_errors=True)

    async def dump(self, workload: Workload, images_dir: Path) -> float:
        work = self._bundle(workload.key) / "criu-work"
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        # The bundle's config travels with the images: the restore side rebuilds the container from it.
        shutil.copy(self._bundle(workload.key) / "config.json", images_dir / "runc-config.json")
        await self._runc(
            "checkpoint", "--image-path", str(images_dir), "--work-path", str(work), workload.key
        )
        await self._runc("delete", "-f", workload.key, check=False)
        return time.monotonic() - started

    def restore_target(self, key: str) -> Workload | None:
        return None  # the restore makes it

    async def prepare_restore(self, key: str, images_dir: Path) -> None:
        return None  # the tree comes back onto the host's own files

    async def finish_restore(self, key: str) -> float | None:
        return None  # prepare_restore leaves nothing running

    async def restore(
        self, key: str, images_dir: Path, source_control_dir: str | None, *, criu: Criu | None = None
    ) -> Workload:
        if criu is not None:
            raise WorkloadRuntimeError("runtime runc runs CRIU itself: it cannot restore with another")
        try:
            template = json.loads((images_dir / "runc-config.json").read_text())
        except (OSError, ValueError) as e:
            raise WorkloadRuntimeError(f"checkpoint lacks its runc config: {e}") from None
        template["hostname"] = key[:63]
        bundle = self._write_bundle(key, None, template)
        work = bundle / "criu-work"
        work.mkdir()
        await self._runc(
            "restore",
            "-d",
            "--image-path",
            str(images_dir),
            "--work-path",
            str(work),
            "--bundle",
            str(bundle),
            key,
        )
        found = await self.find(key)
        if found is None:
            raise WorkloadRuntimeError(f"restored container {key} is not running")
        return found


def _outermost(paths: list[str]) -> list[str]:
    """Drop binds nested in another bind: the outer rbind carries them, and CRIU dislikes the overlap."""
    keep: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


def _last_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:])
