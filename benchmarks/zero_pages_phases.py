"""Where the zero-page rewrite's time goes on this machine, without CRIU: a synthetic pages image laid out
like the reference worker's on the H200 (1 MiB batches all zero, zero-free or mixed, in the proportions
the formats A/B's `pages_stats` counted: 737 / 878 / 517 of 2132), written fresh so that it is dirty in
the page cache as CRIU leaves it, then compacted by criu.sparse (read, compare, write back in place) and
cut short, each step timed.

    python3 benchmarks/zero_pages_phases.py --out benchmarks/results/zero-pages-phases-cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.criu import sparse  # noqa: E402

PAGE = sparse.PAGE
BATCH = sparse._BATCH_PAGES * PAGE


def write_image(path: Path, zero: int, free: int, mixed: int, seed: int) -> int:
    """Batches in a shuffled order; a mixed batch holds runs of zero and random pages."""
    rnd = random.Random(seed)
    noise = os.urandom(BATCH).replace(b"\0", b"\1")
    kinds = ["zero"] * zero + ["free"] * free + ["mixed"] * mixed
    rnd.shuffle(kinds)
    with path.open("wb") as f:
        for kind in kinds:
            if kind == "zero":
                f.write(bytes(BATCH))
            elif kind == "free":
                f.write(noise)
            else:
                pages = bytearray(noise)
                for i in range(sparse._BATCH_PAGES):
                    if rnd.random() < 0.5:
                        pages[i * PAGE : (i + 1) * PAGE] = bytes(PAGE)
                f.write(pages)
    return len(kinds) * sparse._BATCH_PAGES


def timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return round(time.monotonic() - started, 3)


def one_run(path: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    pages = write_image(path, args.zero, args.free, args.mixed, seed)
    entries = [(0x7F0000000000, pages, 6)]
    anywhere = [(0, 1 << 62)]
    fd = os.open(path, os.O_RDWR)
    try:
        phases: dict[str, float] = {}
        t = time.monotonic()
        _, _, dropped = sparse._compact(fd, entries, anywhere, None)
        phases["compact"] = round(time.monotonic() - t, 3)
        phases["truncate"] = timed(lambda: os.ftruncate(fd, (pages - dropped) * PAGE))
        phases["dropped_gb"] = round(dropped * PAGE / 1e9, 3)
    finally:
        os.close(fd)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--zero", type=int, default=737)
    ap.add_argument("--free", type=int, default=878)
    ap.add_argument("--mixed", type=int, default=517)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    path = args.dir / "zero-pages-phases.img"
    try:
        runs = [one_run(path, args, seed) for seed in range(args.runs)]
    finally:
        path.unlink(missing_ok=True)
    emit(
        {
            "image_gb": round((args.zero + args.free + args.mixed) * BATCH / 1e9, 3),
            "runs": runs,
            "cpus": os.cpu_count(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
