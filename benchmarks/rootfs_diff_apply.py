"""How long applying a container's writable layer takes for a tree shaped like a compile cache: thousands of
small files in two-level hash directories (what torch.compile leaves in a GPU worker's container).

    python3 benchmarks/rootfs_diff_apply.py [--dirs 60] [--per-dir 25] [--runs 3]

Captures the tree with ``capture_diff`` and applies it ``--runs`` times into fresh directories; prints the
files, the diff's size and the best apply time. Run it at two commits to compare diff formats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynamo_snapshot.agent.runtime.rootfs_diff import apply_diff, capture_diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirs", type=int, default=60)
    p.add_argument("--per-dir", type=int, default=25)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="diff-apply-"))
    try:
        upper = work / "upper"
        for i in range(args.dirs):
            for j in range(args.per_dir):
                d = upper / "tmp" / "compile-cache" / "inductor" / f"{i:02x}" / f"h{j:03d}"
                d.mkdir(parents=True)
                (d / "kernel.so").write_bytes(os.urandom(20_000))
                (d / "kernel.json").write_bytes(b"{}")
        diff = work / "diff.tar"
        captured = capture_diff(upper, diff)
        times = []
        for run in range(args.runs):
            root = work / f"root-{run}"
            root.mkdir()
            started = time.monotonic()
            apply_diff(diff, root)
            times.append(time.monotonic() - started)
        best = round(min(times), 3)
        print(json.dumps({"files": captured.files, "diff_bytes": diff.stat().st_size, "apply_best_s": best}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
