"""The worker's side of the snapshot handshake, through sentinel files in the pod's control directory.

A worker calls, once its engine is loaded and before it opens connections to the outside world
(NATS, etcd, listening sockets: a checkpoint must not capture them):

    info = SnapshotHandshake.from_env().checkpoint_and_wait()
    if not info.restored:
        sys.exit(0)       # the agent dumped this process and left it running; the copy lives on
    ...connect, serve...

Outside snapshot-enabled pods, `maybe_checkpoint_and_wait()` returns None at once.

Files (names from dynamo_snapshot.api.protocol, spelled as Dynamo spells them):
- ready-for-snapshot, written by the worker: JSON {"pid", "protocol", "timestamp", "info"?, "features"?}.
- release-zero-pages.json / zero-pages-released.json: the agent's request, after the CUDA checkpoint, to
  drop the zero pages of the driver's host copy, and this process's answer (zero_pages.py).
- restore-complete, written by the agent once this process was restored into a new pod.
- snapshot-complete, written by the agent after a dump that left this process running.

Hooks (add_hook) run around the checkpoint: before_checkpoint(handshake) before ready-for-snapshot
is written, on_resume(handshake, info) once the wait ends (restored or dumped and left running).
register_kv_cache and register_weights add the GPU offload hook (offload.GpuOffload), which releases
KV caches and weights so the checkpoint does not carry them, and takes them back after. Without hooks
the handshake only writes the sentinels and waits.

What CRIU restores and what it does not: the process's memory comes back as it was at checkpoint
time, environment included, so os.environ (POD_NAME, POD_IP, ...) still describes the checkpoint pod
after a restore. The new pod's identity comes, in this order, from the restore-complete content when
it is a JSON object ({"env": {...}, "podName", "podIP", "hostname"}), then from what the kubelet
mounts into the new container (/etc/hostname, /etc/hosts), then from uname. What differs between the
containers one snapshot is restored into (an engine's ENGINE_ID, its failover lock) is the restore
container's restore-context.json, given as RestoreInfo.context_env.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dynamo_snapshot.api.protocol import (
    ENV_CONTROL_DIR,
    ENV_CONTROL_DIR_LEGACY,
    FEATURE_RELEASE_ZERO_PAGES,
    FEATURE_RESTORE_COMPLETE_LINES,
    FILE_READY_FOR_SNAPSHOT,
    FILE_RESTORE_COMPLETE,
    FILE_RESTORE_CONTEXT,
    FILE_SNAPSHOT_COMPLETE,
    FILE_ZERO_PAGES_RELEASED,
    FILE_ZERO_PAGES_REQUEST,
    PROTOCOL_VERSION,
    READY_FEATURES,
    RESTORE_COMPLETE_DOC_KEY,
    RESTORE_COMPLETE_PID_KEY,
)
from dynamo_snapshot.fileio import write_atomic
from dynamo_snapshot.workload.zero_pages import ZeroPageServer

if TYPE_CHECKING:
    from dynamo_snapshot.workload.offload import GpuOffload, ReleasableCache, SavableWeights

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "NoControlDirError",
    "RestoreInfo",
    "SnapshotHandshake",
    "SnapshotHook",
    "control_dir",
    "maybe_checkpoint_and_wait",
    "maybe_checkpoint_and_wait_async",
    "maybe_signal_ready",
    "maybe_signal_ready_async",
    "parse_restore_complete",
]

log = logging.getLogger(__name__)

# A restored worker wakes within one interval of restore-complete: it is part of every restore's time.
DEFAULT_POLL_INTERVAL = 0.02
_ETC = Path("/etc")
# A single poll that took longer than this was not spent polling: the process was frozen (checkpoint)
# or restored, maybe on another machine whose CLOCK_MONOTONIC is unrelated. Such gaps do not count
# toward a timeout, or a restored worker would time out the moment it wakes up.
_MAX_COUNTED_GAP = 1.0
# The agent may create the sentinel and fill it in two steps; content that does not parse is read
# again this often, at most this many times, until two reads agree.
_STABLE_READ_DELAY = 0.02
_STABLE_READ_TRIES = 5


class NoControlDirError(RuntimeError):
    """No snapshot control directory is configured for this process."""

    def __init__(self) -> None:
        super().__init__(
            f"no snapshot control dir: set {ENV_CONTROL_DIR} "
            f"(or the legacy {ENV_CONTROL_DIR_LEGACY}) to the directory shared with the node agent"
        )


def control_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The control directory from SNAPSHOT_CONTROL_DIR, else DYN_SNAPSHOT_CONTROL_DIR; None if neither.

    When both are set and differ, the new name wins and a warning says so.
    """
    return _configured_dir(environ)


def _configured_dir(environ: Mapping[str, str] | None) -> Path | None:
    env = os.environ if environ is None else environ
    new = env.get(ENV_CONTROL_DIR) or None
    legacy = env.get(ENV_CONTROL_DIR_LEGACY) or None
    if new and legacy and Path(new) != Path(legacy):
        log.warning(
            "%s=%s and %s=%s differ; using %s",
            ENV_CONTROL_DIR,
            new,
            ENV_CONTROL_DIR_LEGACY,
            legacy,
            new,
        )
    chosen = new or legacy
    return Path(chosen) if chosen else None


@dataclass(frozen=True)
class RestoreInfo:
    """How the wait ended, and who this process is now."""

    restored: bool  # True: restored into a new pod; False: dumped and left running (snapshot-complete)
    hostname: str
    pod_name: str | None
    pod_ip: str | None
    content: Any  # the sentinel parsed as JSON, else its text; None when empty
    env: Mapping[str, str] = field(default_factory=dict)  # restore-time env the agent passed, if any
    waited_s: float = 0.0
    # The restore container's own values of the names Dynamo carries across a restore
    # (restore-context.json: ENGINE_ID, FAILOVER_LOCK_PATH, DYN_SYSTEM_PORT, ...): what differs between
    # containers a snapshot is restored into; empty when not restored or not given.
    context_env: Mapping[str, str] = field(default_factory=dict)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _parse(text: str) -> tuple[Any, bool]:
    """(content, complete): JSON when it parses, else the restore-pod contract's lines as a dict, else
    the text; complete=False when it may be partial."""
    stripped = text.strip()
    if not stripped:
        return None, False
    try:
        return json.loads(stripped), True
    except ValueError:
        pass
    fields = _contract_lines(stripped)
    if fields is None:
        return stripped, False
    # The contract's writer ends every line: a file without the last newline may still be growing.
    return fields, text.endswith("\n")


def parse_restore_complete(text: str) -> dict[str, Any] | None:
    """restore-complete's content as one document, whichever way the agent wrote it (the contract's lines,
    or JSON); None when the text is neither (or not whole)."""
    content, complete = _parse(text)
    return content if complete and isinstance(content, dict) else None


def _contract_lines(text: str) -> dict[str, Any] | None:
    """restore-complete as the restore-pod contract writes it, "key=value" lines: the agent's JSON
    document (RESTORE_COMPLETE_DOC_KEY) with the contract's pid beside it, or the pid alone (an agent that
    writes nothing else); None when the text is not that."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, value = line.strip().partition("=")
        if not eq or not key:
            return None
        fields[key] = value
    doc: dict[str, Any] = {}
    if RESTORE_COMPLETE_DOC_KEY in fields:
        try:
            parsed = json.loads(fields[RESTORE_COMPLETE_DOC_KEY])
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        doc.update(parsed)
    pid = fields.get(RESTORE_COMPLETE_PID_KEY)
    if pid is not None:
        if not pid.isdigit():
            return None
        doc[RESTORE_COMPLETE_PID_KEY] = int(pid)
    return doc or None


def _context_env(path: Path) -> dict[str, str]:
    """restore-context.json's ``env`` (names with a value): written before restore-complete, by the
    restore container's standby entrypoint or the agent."""
    text = _read_text(path)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return {}
    env = doc.get("env") if isinstance(doc, dict) else None
    if not isinstance(env, dict):
        return {}
    return {k: v for k, v in env.items() if isinstance(k, str) and isinstance(v, str)}


def _etc_hostname() -> str | None:
    text = _read_text(_ETC / "hostname")
    return (text.strip() or None) if text else None


def _etc_hosts_ip(hostname: str) -> str | None:
    """The address /etc/hosts gives `hostname`: the kubelet writes the pod IP there."""
    text = _read_text(_ETC / "hosts")
    if not text:
        return None
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and hostname in fields[1:] and not fields[0].startswith(("127.", "::1")):
            return fields[0]
    return None


def _str_field(mapping: Mapping[str, Any], *names: str) -> str | None:
    for name in names:
        value = mapping.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def _identity(content: Any, restored: bool) -> tuple[str, str | None, str | None, dict[str, str]]:
    given: Mapping[str, Any] = content if isinstance(content, Mapping) else {}
    raw_env = given.get("env")
    env = (
        {k: v for k, v in raw_env.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(raw_env, Mapping)
        else {}
    )
    hostname = _str_field(given, "hostname") or _etc_hostname() or socket.gethostname()
    pod_name = _str_field(env, "POD_NAME") or _str_field(given, "podName", "pod_name")
    pod_ip = _str_field(env, "POD_IP") or _str_field(given, "podIP", "pod_ip")
    if not restored:
        # Still the process that started in this pod: its environment is current.
        pod_name = pod_name or os.environ.get("POD_NAME") or None
        pod_ip = pod_ip or os.environ.get("POD_IP") or None
    # A pod's hostname is its name unless spec.hostname says otherwise.
    pod_name = pod_name or hostname
    pod_ip = pod_ip or _etc_hosts_ip(hostname)
    return hostname, pod_name, pod_ip, env


class SnapshotHook(Protocol):
    """Work around a checkpoint: before_checkpoint runs before ready-for-snapshot is written (an
    exception there means no ready file), on_resume after the wait for the agent ended (info) or
    after a later hook's before_checkpoint failed (info None), to undo what before_checkpoint did."""

    def before_checkpoint(self, handshake: SnapshotHandshake) -> None: ...

    def on_resume(self, handshake: SnapshotHandshake, info: RestoreInfo | None) -> None: ...


class SnapshotHandshake:
    """The sentinel files of one control directory. Sync methods block; *_async ones only await.

    Thread-safe in the sense that matters: every method works on files only, so engines may call the
    sync API from their own threads. Hooks are the exception: register them before the handshake.
    """

    def __init__(self, control_dir: Path | str | None = None, *, release_zero_pages: bool = True) -> None:
        """`control_dir` defaults to the configured one; NoControlDirError when there is none.
        `release_zero_pages`: offer the agent to drop the zero pages of the CUDA checkpoint's host copy
        from this process before CRIU dumps it (zero_pages.py)."""
        if control_dir is None:
            control_dir = _configured_dir(None)
            if control_dir is None:
                raise NoControlDirError()
        self.control_dir = Path(control_dir)
        self.release_zero_pages = release_zero_pages
        self._zero_pages: ZeroPageServer | None = None
        self._hooks: list[SnapshotHook] = []
        self._armed: list[SnapshotHook] = []  # hooks whose before_checkpoint ran, awaiting on_resume
        self._offload: GpuOffload | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SnapshotHandshake:
        """The handshake for the control dir `environ` (default os.environ) names; else NoControlDirError."""
        found = _configured_dir(environ)
        if found is None:
            raise NoControlDirError()
        return cls(found)

    @classmethod
    def maybe_from_env(cls, environ: Mapping[str, str] | None = None) -> SnapshotHandshake | None:
        """Like from_env, but None outside snapshot-enabled pods."""
        found = _configured_dir(environ)
        return cls(found) if found is not None else None

    # ---- hooks ----

    def add_hook(self, hook: SnapshotHook) -> None:
        """Run `hook` around the checkpoint; hooks run in the order added (on_resume too)."""
        self._hooks.append(hook)

    @property
    def gpu_offload(self) -> GpuOffload:
        """The GPU offload hook (created and added on first use), with its report of the last cycle."""
        if self._offload is None:
            from dynamo_snapshot.workload.offload import GpuOffload

            self._offload = GpuOffload()
            self.add_hook(self._offload)
        return self._offload

    def register_kv_cache(self, cache: ReleasableCache) -> None:
        """Release `cache` (a KvCache) before the checkpoint and reacquire it after."""
        self.gpu_offload.add_kv_cache(cache)

    def register_weights(self, weights: SavableWeights, path: Path | str) -> None:
        """Save `weights` (a WeightRegion) to `path` and release them before the checkpoint (listing
        the file in weights.json), and load them from `path` after."""
        self.gpu_offload.add_weights(weights, path)

    def _before_checkpoint(self) -> None:
        for hook in self._hooks:
            if hook in self._armed:
                continue  # signal_ready twice without a wait between: already done
            self._armed.append(hook)
            try:
                hook.before_checkpoint(self)
            except BaseException:
                # Undo in reverse what was done, the failing hook included, so the worker can go on.
                self._resume_hooks(None, quiet=True)
                raise

    def _resume_hooks(self, info: RestoreInfo | None, *, quiet: bool = False) -> None:
        armed, self._armed = self._armed, []
        for hook in reversed(armed) if info is None else armed:
            try:
                hook.on_resume(self, info)
            except Exception:
                if not quiet:
                    raise
                log.exception("undoing snapshot hook %r failed", hook)

    @property
    def ready_path(self) -> Path:
        return self.control_dir / FILE_READY_FOR_SNAPSHOT

    @property
    def restore_complete_path(self) -> Path:
        return self.control_dir / FILE_RESTORE_COMPLETE

    @property
    def snapshot_complete_path(self) -> Path:
        return self.control_dir / FILE_SNAPSHOT_COMPLETE

    # ---- ready-for-snapshot ----

    def signal_ready(self, info: Mapping[str, Any] | None = None) -> None:
        """Tell the agent this process may be checkpointed now.

        Call after the engine is initialised and before opening outside connections. The file appears
        complete or not at all (written aside, then renamed). Sentinels left from an earlier run in
        this pod are removed first: a container restarted in the same pod must not take an old
        restore-complete for its own.
        """
        payload: dict[str, Any] = {"pid": os.getpid(), "protocol": PROTOCOL_VERSION, "timestamp": time.time()}
        if info is not None:
            payload["info"] = dict(info)
        # This SDK reads restore-complete as the restore-pod contract writes it (and as JSON).
        payload[READY_FEATURES] = [FEATURE_RESTORE_COMPLETE_LINES] + (
            [FEATURE_RELEASE_ZERO_PAGES] if self.release_zero_pages else []
        )
        data = json.dumps(payload, sort_keys=True).encode()  # fails here, before anything is written
        if not self.control_dir.is_dir():
            raise FileNotFoundError(f"snapshot control dir {self.control_dir} does not exist")
        if self._hooks:
            self._before_checkpoint()
            payload["timestamp"] = time.time()  # the ready time, after the hooks' work
            data = json.dumps(payload, sort_keys=True).encode()
        try:
            self._write_ready(data)
        except BaseException:
            # No ready file, so no checkpoint is coming: give the worker back what the hooks took.
            if self._armed:
                self._resume_hooks(None, quiet=True)
            raise

    def _write_ready(self, data: bytes) -> None:
        stale_files = (
            FILE_RESTORE_COMPLETE,
            FILE_SNAPSHOT_COMPLETE,
            FILE_ZERO_PAGES_REQUEST,
            FILE_ZERO_PAGES_RELEASED,
        )
        for stale in stale_files:
            (self.control_dir / stale).unlink(missing_ok=True)
        if self.release_zero_pages and (self._zero_pages is None or not self._zero_pages.thread.is_alive()):
            self._zero_pages = ZeroPageServer(self.control_dir, lambda: self._poll() is not None)
            self._zero_pages.start()
        # 0644: the agent and probes may be other users. Durable: the rename survives a crash of the node.
        write_atomic(self.ready_path, data, mode=0o644)

    async def signal_ready_async(self, info: Mapping[str, Any] | None = None) -> None:
        # fsync can take a while on a busy disk: keep it off the event loop.
        await asyncio.to_thread(self.signal_ready, info)

    # ---- waiting ----

    def was_restored(self) -> bool:
        """True when the agent has written restore-complete: this process was restored."""
        return self.restore_complete_path.exists()

    def _poll(self) -> bool | None:
        if self.restore_complete_path.exists():
            return True
        if self.snapshot_complete_path.exists():
            return False
        return None

    def _sentinel_content(self, restored: bool) -> tuple[Any, bool]:
        """(content, complete) of the sentinel, once; `complete` False means read it again shortly."""
        path = self.restore_complete_path if restored else self.snapshot_complete_path
        text = _read_text(path)
        return _parse(text) if text is not None else (None, False)

    def _result(self, restored: bool, content: Any, waited: float) -> RestoreInfo:
        hostname, pod_name, pod_ip, env = _identity(content, restored)
        context = _context_env(self.control_dir / FILE_RESTORE_CONTEXT) if restored else {}
        return RestoreInfo(restored, hostname, pod_name, pod_ip, content, env, waited, context)

    @staticmethod
    def _check_args(poll_interval: float, timeout: float | None) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")

    def _gave_up(self, timeout: float) -> TimeoutError:
        """The error for a wait that timed out; no zero-page request will come now either."""
        if self._zero_pages is not None:
            self._zero_pages.stop()
        return TimeoutError(
            f"no {FILE_RESTORE_COMPLETE} (or {FILE_SNAPSHOT_COMPLETE}) in {self.control_dir} "
            f"after {timeout:g} s: the node agent has neither checkpointed nor restored this process"
        )

    def wait_for_restore(
        self, poll_interval: float = DEFAULT_POLL_INTERVAL, timeout: float | None = None
    ) -> RestoreInfo:
        """Block until the agent restored this process (restored=True) or dumped it and left it
        running (restored=False), polling every `poll_interval` s. TimeoutError after `timeout` s of
        polling; time the process spent frozen is not counted.
        """
        self._check_args(poll_interval, timeout)
        waited = 0.0
        last = time.monotonic()
        while (state := self._poll()) is None:
            if timeout is not None and waited >= timeout:
                raise self._gave_up(timeout)
            time.sleep(poll_interval)
            now = time.monotonic()
            waited += _counted(now - last)
            last = now
        content, complete = self._sentinel_content(state)
        for _ in range(_STABLE_READ_TRIES):
            if complete:
                break
            time.sleep(_STABLE_READ_DELAY)
            again, complete = self._sentinel_content(state)
            # Empty is what a file just created looks like: keep reading it until the tries run out.
            stable, content = again is not None and again == content, again
            if stable:
                break
        result = self._result(state, content, waited)
        if self._armed:
            self._resume_hooks(result)
        return result

    # `timeout` rather than asyncio.timeout(): the loop's clock would count the time the process spent
    # frozen or on another machine, and a restored worker must not time out on waking.
    async def wait_for_restore_async(
        self,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> RestoreInfo:
        """wait_for_restore for an event loop: polls with asyncio.sleep."""
        self._check_args(poll_interval, timeout)
        waited = 0.0
        last = time.monotonic()
        while (state := self._poll()) is None:
            if timeout is not None and waited >= timeout:
                raise self._gave_up(timeout)
            await asyncio.sleep(poll_interval)
            now = time.monotonic()
            waited += _counted(now - last)
            last = now
        content, complete = self._sentinel_content(state)
        for _ in range(_STABLE_READ_TRIES):
            if complete:
                break
            await asyncio.sleep(_STABLE_READ_DELAY)
            again, complete = self._sentinel_content(state)
            # Empty is what a file just created looks like: keep reading it until the tries run out.
            stable, content = again is not None and again == content, again
            if stable:
                break
        result = self._result(state, content, waited)
        if self._armed:
            # Loading weights blocks for seconds: off the event loop.
            await asyncio.to_thread(self._resume_hooks, result)
        return result

    def checkpoint_and_wait(
        self,
        info: Mapping[str, Any] | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        timeout: float | None = None,
    ) -> RestoreInfo:
        """signal_ready, then wait_for_restore."""
        self.signal_ready(info)
        return self.wait_for_restore(poll_interval, timeout)

    async def checkpoint_and_wait_async(
        self,
        info: Mapping[str, Any] | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        timeout: float | None = None,  # noqa: ASYNC109  (see wait_for_restore_async)
    ) -> RestoreInfo:
        await self.signal_ready_async(info)
        return await self.wait_for_restore_async(poll_interval, timeout)


def _counted(gap: float) -> float:
    return min(max(gap, 0.0), _MAX_COUNTED_GAP)


# ---- no-ops outside snapshot-enabled pods ---------------------------------------------------------


def maybe_signal_ready(info: Mapping[str, Any] | None = None) -> bool:
    """signal_ready when a control dir is configured; returns whether it was."""
    handshake = SnapshotHandshake.maybe_from_env()
    if handshake is None:
        return False
    handshake.signal_ready(info)
    return True


async def maybe_signal_ready_async(info: Mapping[str, Any] | None = None) -> bool:
    handshake = SnapshotHandshake.maybe_from_env()
    if handshake is None:
        return False
    await handshake.signal_ready_async(info)
    return True


def maybe_checkpoint_and_wait(
    info: Mapping[str, Any] | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    timeout: float | None = None,
) -> RestoreInfo | None:
    """checkpoint_and_wait when a control dir is configured, else None at once."""
    handshake = SnapshotHandshake.maybe_from_env()
    if handshake is None:
        return None
    return handshake.checkpoint_and_wait(info, poll_interval, timeout)


async def maybe_checkpoint_and_wait_async(
    info: Mapping[str, Any] | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    timeout: float | None = None,  # noqa: ASYNC109  (see wait_for_restore_async)
) -> RestoreInfo | None:
    handshake = SnapshotHandshake.maybe_from_env()
    if handshake is None:
        return None
    return await handshake.checkpoint_and_wait_async(info, poll_interval, timeout)
