"""How fast the SDK's zero-page release scans memory (workload.zero_pages.release_zero_pages), on this
machine, against the same function at other commits (--baseline).

Kinds of memory, --mib of each, private anonymous: zero-rich pages (the first KiB random, the rest
zeros, like the data of a CUDA host copy), random pages, all zero, mixed (every third page zero), and
islands (all zero but for 4 zero-rich pages every 232 pages: about 1,130 runs of zero pages per GiB, as
the reference worker's host copy on the H200). For each kind and each version: the release's seconds
(best of --repeat, the memory refilled before each) and the seconds of its madvise calls where the
version reports them.

    .venv/bin/python benchmarks/zero_page_scan.py --baseline 7af2e7b --baseline 6733387 \
        --out benchmarks/results/zero-page-scan-cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.workload.zero_pages import release_zero_pages  # noqa: E402

PAGE = mmap.PAGESIZE
MIB = 1 << 20
Release = Callable[[list[tuple[int, int]]], Any]


def _zero_rich(n: int) -> bytes:
    out = bytearray(n)
    for off in range(0, n, PAGE):
        out[off : off + 1024] = os.urandom(1024)
    return bytes(out)


def _islands(n: int) -> bytes:
    out = bytearray(n)
    for off in range(0, n - 4 * PAGE, 232 * PAGE):
        out[off : off + 4 * PAGE] = _zero_rich(4 * PAGE)
    return bytes(out)


def _mixed(n: int) -> bytes:
    out = bytearray(os.urandom(n))
    for off in range(0, n, 3 * PAGE):
        out[off : off + PAGE] = bytes(PAGE)
    return bytes(out)


KINDS: dict[str, Callable[[int], bytes]] = {
    "zero_rich": _zero_rich,
    "random": os.urandom,
    "all_zero": bytes,
    "mixed": _mixed,
    "islands": _islands,
}


def _version(rev: str) -> Release:
    """release_zero_pages as workload/zero_pages.py was at commit ``rev``."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:dynamo_snapshot/workload/zero_pages.py"],
        check=True,
        capture_output=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:  # the module lives on in memory once executed
        path = Path(tmp) / f"zero_pages_{rev}.py"
        path.write_bytes(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    release: Release = module.release_zero_pages
    return release


def measure(kind: str, mib: int, repeat: int, versions: dict[str, Release]) -> dict[str, object]:
    size = mib * MIB
    data = KINDS[kind](size)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    out: dict[str, object] = {"kind": kind, "mib": mib}
    for name, release in versions.items():
        best = None
        for _ in range(repeat):
            m[:] = data  # every page present again, the released ones included
            stats = release([(addr, addr + size)])
            best = stats if best is None or stats.seconds < best.seconds else best
        assert best is not None
        out[name] = {
            "release_s": round(best.seconds, 4),
            "madvise_s": round(best.madvise_seconds, 4) if hasattr(best, "madvise_seconds") else None,
            "released_mib": best.released_bytes // MIB,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes of each kind (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", action="append", default=[], help="a commit to time as well")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    versions = {"current": release_zero_pages, **{rev: _version(rev) for rev in args.baseline}}
    runs = [measure(kind, args.mib, args.repeat, versions) for kind in KINDS]
    emit({"cpus": os.cpu_count(), "runs": runs}, args.out)


if __name__ == "__main__":
    main()
