"""CRIU version parsing, command lines, log excerpts and the files a run reads: no CRIU needed (but for
one test marked criu)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu, CriuError, CriuVersion, TreeOptions, dump_argv, restore_argv, runner
from dynamo_snapshot.criu.errors import log_excerpt, summary_line
from dynamo_snapshot.criu.runner import parse_ldd, shebang_interpreter

DUMP_LOG = """\
(00.000000) Version: 4.1.1 (gitid 0)
(00.025240) Warn  (criu/seize.c:63): Failed to open /proc/4242/comm: No such file or directory
(00.025248) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.025700) net: Unlock network
(00.025759) Unfreezing tasks into 1
(00.025762) Error (compel/src/lib/infect.c:418): Unable to detach from 4242: No such process
(00.025768) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Version: 4.1.1\n", CriuVersion(4, 1, 1)),
        ("Version: 3.17\n", CriuVersion(3, 17, 0)),
        ("Version: 4.0\nGitID: v4.0-12-gdeadbeef\n", CriuVersion(4, 0, 0)),
        ("  Version:  4.2.10  \n", CriuVersion(4, 2, 10)),
    ],
)
def test_version_parse(text: str, expected: CriuVersion) -> None:
    assert CriuVersion.parse(text) == expected


@pytest.mark.parametrize("text", ["", "criu: command not found", "Version: four"])
def test_version_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot read a CRIU version"):
        CriuVersion.parse(text)


def test_version_order_and_text() -> None:
    assert CriuVersion(3, 17) < CriuVersion(4, 0) < CriuVersion(4, 0, 1) < CriuVersion(4, 1)
    assert CriuVersion(4, 1).at_least((4, 0))
    assert not CriuVersion(3, 17).at_least((4, 0))
    assert CriuVersion(4, 1, 1).at_least((4, 1, 1))
    assert (str(CriuVersion(3, 17)), str(CriuVersion(4, 1, 1))) == ("3.17", "4.1.1")


def test_dump_argv_defaults() -> None:
    argv = dump_argv(123, Path("/img"))
    assert argv[:3] == ["dump", "-t", "123"]
    assert argv[argv.index("-D") + 1] == "/img"
    assert argv[argv.index("-W") + 1] == "/img"
    assert argv[argv.index("-o") + 1] == "dump.log"
    assert "-v4" in argv
    for flag in ("--ext-unix-sk", "--file-locks", "--link-remap"):
        assert flag in argv
    for flag in ("--leave-running", "--tcp-established", "--shell-job", "--ghost-limit"):
        assert flag not in argv


def test_dump_argv_options() -> None:
    argv = dump_argv(
        7,
        Path("/img"),
        work_dir=Path("/logs"),
        leave_running=True,
        options=TreeOptions(ext_unix_sk=False, file_locks=False, tcp_established=True, shell_job=True),
        link_remap=False,
        ghost_limit=64 << 20,
        extra_args=("--manage-cgroups", "ignore"),
    )
    assert argv[argv.index("-W") + 1] == "/logs"
    assert argv[argv.index("--ghost-limit") + 1] == str(64 << 20)
    assert argv[-2:] == ["--manage-cgroups", "ignore"]
    for flag in ("--leave-running", "--tcp-established", "--shell-job"):
        assert flag in argv
    for flag in ("--ext-unix-sk", "--file-locks", "--link-remap"):
        assert flag not in argv


def test_dump_argv_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="invalid pid"):
        dump_argv(0, Path("/img"))
    with pytest.raises(ValueError, match="invalid ghost_limit"):
        dump_argv(1, Path("/img"), ghost_limit=-1)


def test_restore_argv() -> None:
    argv = restore_argv(Path("/img"), Path("/run/r.pid"), work_dir=Path("/logs"))
    assert argv[0] == "restore"
    assert argv[argv.index("--pidfile") + 1] == "/run/r.pid"
    assert argv[argv.index("-o") + 1] == "restore.log"
    assert "--restore-detached" in argv
    assert "--restore-sibling" not in argv
    assert "--leave-stopped" not in argv
    argv = restore_argv(
        Path("/img"),
        Path("/p"),
        detach=False,
        restore_sibling=True,
        options=TreeOptions(tcp_established=True),
        leave_stopped=True,
    )
    assert "--restore-detached" not in argv
    assert "--restore-sibling" in argv
    assert "--tcp-established" in argv
    assert "--leave-stopped" in argv


def test_relative_paths_become_absolute() -> None:
    argv = restore_argv(Path("img"), Path("r.pid"))
    assert argv[argv.index("-D") + 1] == str(Path("img").absolute())
    assert argv[argv.index("--pidfile") + 1] == str(Path("r.pid").absolute())


def test_log_excerpt_keeps_problems_and_tail() -> None:
    excerpt = log_excerpt(DUMP_LOG)
    assert excerpt[0].endswith("Failed to open /proc/4242/comm: No such file or directory")
    assert excerpt[-1].endswith("Dumping FAILED.")
    assert not any("Version: 4.1.1" in line for line in excerpt)
    assert any("Unfreezing tasks" in line for line in excerpt)  # tail context
    assert summary_line(excerpt) == "Unable to detach from 4242: No such process"


def test_log_excerpt_limits_problem_lines() -> None:
    text = "\n".join(f"(0.{i}) Error (x.c:1): problem {i}" for i in range(50))
    excerpt = log_excerpt(text, problems=10, tail=3)
    assert len(excerpt) == 10
    assert excerpt[0].endswith("problem 40")


def test_error_text_quotes_log() -> None:
    excerpt = log_excerpt(DUMP_LOG)
    err = CriuError("dump", 1, summary_line(excerpt) or "", excerpt, log_path=Path("/img/dump.log"))
    text = str(err)
    assert text.startswith("criu dump failed (exit 1): Unable to detach from 4242: No such process")
    assert "/img/dump.log" in text
    assert "Failed to open /proc/4242/comm" in text
    assert "exit code" not in text


def _fake_criu(tmp_path: Path, version_line: str) -> Path:
    path = tmp_path / "criu"
    path.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    path.chmod(0o755)
    return path


async def test_require_too_old(tmp_path: Path) -> None:
    criu = Criu(_fake_criu(tmp_path, "Version: 3.17"))
    with pytest.raises(CriuError) as err:
        await criu.require(min=(4, 0))
    assert str(err.value) == "CRIU 3.17 is too old: need >= 4.0 (3.17 fails on this kernel's vDSO)"


async def test_require_accepts_new_enough(tmp_path: Path) -> None:
    assert await Criu(_fake_criu(tmp_path, "Version: 4.1.1")).require() == CriuVersion(4, 1, 1)


async def test_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CriuError, match=r"^criu not found: .*/nope is not an executable file$"):
        await Criu(tmp_path / "nope").require()
    monkeypatch.setenv("DYNSNAP_CRIU", str(tmp_path / "missing"))
    with pytest.raises(CriuError, match=r"^criu not found: \$DYNSNAP_CRIU="):
        await Criu().version()
    monkeypatch.delenv("DYNSNAP_CRIU")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    with pytest.raises(CriuError, match=r"^criu not found: neither \$DYNSNAP_CRIU nor PATH names one"):
        await Criu().version()


async def test_env_binary_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNSNAP_CRIU", os.fspath(_fake_criu(tmp_path, "Version: 4.9")))
    assert await Criu().version() == CriuVersion(4, 9)


def test_parse_ldd_keeps_resolved_paths_only() -> None:
    out = (
        "\tlinux-vdso.so.1 (0x00007ffd4f9e5000)\n"
        "\tlibprotobuf-c.so.1 => /lib/x86_64-linux-gnu/libprotobuf-c.so.1 (0x00007f1e2a000000)\n"
        "\tlibnl-3.so.200 => not found\n"
        "\t/lib64/ld-linux-x86-64.so.2 (0x00007f1e2a400000)\n"
    )
    assert parse_ldd(out) == [
        Path("/lib/x86_64-linux-gnu/libprotobuf-c.so.1"),
        Path("/lib64/ld-linux-x86-64.so.2"),
    ]


async def test_files_of_a_wrapper_script_are_its_interpreter_and_its_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "lib").mkdir(parents=True)
    wrapper = bundle / "criu-wrapper.sh"
    wrapper.write_text('#!/bin/sh\nexec "$(dirname "$0")/criu" "$@"\n')
    wrapper.chmod(0o755)
    (bundle / "criu").write_bytes(b"\x7fELF")
    (bundle / "lib" / "libprotobuf-c.so.1").write_bytes(b"x")
    files = await Criu(wrapper).files()
    # /bin/sh first (exec'd before anything of the bundle), with its libraries; then the bundle.
    assert files[0] == Path("/bin/sh")
    assert any(f.name.startswith("libc.so") for f in files)
    assert sorted(f for f in files if f.is_relative_to(bundle)) == sorted(
        [wrapper, bundle / "criu", bundle / "lib" / "libprotobuf-c.so.1"]
    )


def test_shebang_interpreter() -> None:
    assert shebang_interpreter(b"#!/bin/sh\n") == Path("/bin/sh")
    assert shebang_interpreter(b"#! /bin/sh -e\n") == Path("/bin/sh")
    assert shebang_interpreter(b"#!sh\n") is None  # not a path the kernel would run
    assert shebang_interpreter(b"#!/nonexistent/shell\n") is None
    assert shebang_interpreter(b"#!/usr/bin/env sh\n") == Path(shutil.which("sh") or "")
    assert shebang_interpreter(b"#!\n") is None


@pytest.mark.criu
async def test_files_of_a_real_criu_are_the_binary_and_its_libraries(criu_bin: Path) -> None:
    files = await Criu(criu_bin).files()
    _check_real_criu_files(criu_bin, files)


def _check_real_criu_files(criu_bin: Path, files: list[Path]) -> None:
    assert all(f.is_file() for f in files)
    if criu_bin.read_bytes()[:2] == b"#!":  # a bundle: its interpreter, then its own directory
        assert any(f.is_relative_to(criu_bin.parent) for f in files)
    else:
        assert files[0] == criu_bin
        assert any(f.name.startswith("libprotobuf-c") for f in files), files


# The ends of two dumps of a torch NCCL worker on the H200 (Linux 6.18, CRIU 4.1.1).
SOCKOPT_LOG = """(00.075107) sockets: Searching for socket 0x3dd8 family 2
(00.075118) Error (criu/sockets.c:628): sockets: Can't get 1:16 opt: Operation not supported
(00.075120) Error (criu/sockets.c:628): sockets: Can't get 1:34 opt: Operation not supported
(00.075123) sockets: No filter for socket
(00.075134) Error (criu/cr-dump.c:1681): Dump files (pid: 623) failed with -1
(00.092358) Unfreezing tasks into 1
(00.116414) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""
CONNECTED_LOG = """(00.094490) Error (criu/sk-inet.c:191): inet: Connected TCP socket, consider using \
--tcp-established option.
(00.094509) Error (criu/cr-dump.c:1681): Dump files (pid: 520) failed with -1
(00.116414) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""


@pytest.mark.parametrize(
    ("log", "says"),
    [
        (SOCKOPT_LOG, "cannot dump a TCP or UDP socket on Linux 6.16 or later"),
        (CONNECTED_LOG, "holds an established TCP connection"),
    ],
)
def test_a_failure_with_a_known_cause_says_what_to_do(tmp_path: Path, log: str, says: str) -> None:
    (tmp_path / "dump.log").write_text(log)
    err = runner._failure("dump", 1, "", tmp_path / "dump.log")
    assert str(err).startswith("criu dump failed (exit 1): ")
    assert says in err.message
    assert "Dump files" in str(err)  # CRIU's own lines stay in the excerpt
    plain = runner._failure("dump", 1, "", _log(tmp_path, DUMP_LOG))
    assert plain.message == "Unable to detach from 4242: No such process"


def _log(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plain.log"
    path.write_text(text)
    return path
