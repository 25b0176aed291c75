#!/usr/bin/env python3
"""The node's binaries packed for the GPU machine, and unpacked there (Python's standard library alone: the
machine has Python 3.12 and no project dependencies).

    python3 scripts/gpu_bundle.py pack DIR [--bin BIN] [--budget-mib 50]
    python3 scripts/gpu_bundle.py unpack DIR [--into BIN]

`pack` puts into DIR (an ignored path, carried by the device call) what scripts/test-env.sh built into BIN
(default $DYNSNAP_CACHE/bin, else ~/.cache/dynamo-snapshot/bin) that a node needs: dsnap-multicall and
every link to it, runc, the CNI plugins in cni/, and CRIU with the shared libraries it links
(benchmarks/gpu/criu_bundle_from_build.sh; the machine's glibc serves), each compressed with xz -9e,
beside manifest.json (names, sizes and SHA-256 of the uncompressed files, link targets). It refuses,
naming the largest parts, when the compressed total exceeds the budget.

`unpack` lays them out in BIN as they are here, links included, each file checked against its size and
digest before it takes its name; CRIU's libraries go to BIN/criu-bundle/, and BIN/criu runs it with them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
MIB = 1 << 20
DEFAULT_BUDGET_MIB = 50.0
MULTICALL = "dsnap-multicall"
CNI_PLUGINS = ("bridge", "host-local", "loopback")
CRIU_DIR = "criu-bundle"
REPO = Path(__file__).resolve().parents[1]
CRIU_BUNDLER = REPO / "benchmarks" / "gpu" / "criu_bundle_from_build.sh"
XZ_PRESET = 9 | lzma.PRESET_EXTREME
CHUNK = 4 * MIB


class BundleError(RuntimeError):
    """What is wrong with the bundle or the binaries, in one line."""


@dataclass(frozen=True)
class Part:
    name: str  # path inside BIN, e.g. "cni/bridge"
    source: Path


def default_bin() -> Path:
    cache = os.environ.get("DYNSNAP_CACHE") or str(Path.home() / ".cache" / "dynamo-snapshot")
    return Path(cache) / "bin"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def node_parts(bin_dir: Path) -> tuple[list[Part], dict[str, str]]:
    """The files a node needs from ``bin_dir`` and the links to the multi-call program, by name."""
    multicall = bin_dir / MULTICALL
    needed = [multicall, bin_dir / "runc", *(bin_dir / "cni" / p for p in CNI_PLUGINS)]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise BundleError(f"not built: {', '.join(missing)}: run scripts/test-env.sh first")
    links = {
        p.name: os.readlink(p)
        for p in sorted(bin_dir.iterdir())
        if p.is_symlink() and os.readlink(p) == MULTICALL
    }
    if not links:
        raise BundleError(f"no link to {MULTICALL} in {bin_dir}: run scripts/test-env.sh first")
    return [Part(str(p.relative_to(bin_dir)), p) for p in needed], links


def criu_parts(criu: Path, work: Path) -> list[Part]:
    """CRIU and the libraries it links (not glibc's), as the device scripts' bundle has them."""
    if not criu.is_file():
        raise BundleError(f"no CRIU build at {criu}: run scripts/test-env.sh first")
    out = work / CRIU_DIR
    env = {**os.environ, "DYNSNAP_CRIU_BUILD": str(criu)}
    proc = subprocess.run(
        ["bash", str(CRIU_BUNDLER), str(out)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BundleError(f"{CRIU_BUNDLER.name} failed: {(proc.stderr or proc.stdout).strip()}")
    return [Part(f"{CRIU_DIR}/{p.relative_to(out)}", p) for p in sorted(out.rglob("*")) if p.is_file()]


def _compress(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    comp = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)
    with source.open("rb") as src, target.open("wb") as dst:
        while block := src.read(CHUNK):
            dst.write(comp.compress(block))
        dst.write(comp.flush())


def _largest(entries: list[dict[str, Any]], n: int = 4) -> str:
    top = sorted(entries, key=lambda e: int(e["xz_size"]), reverse=True)[:n]
    return ", ".join(f"{e['name']} {int(e['xz_size']) / MIB:.1f} MiB" for e in top)


def pack(out: Path, bin_dir: Path, budget_mib: float, criu: Path | None) -> dict[str, Any]:
    """Compress the node's parts into ``out``; refused over ``budget_mib`` (``out`` then removed)."""
    parts, links = node_parts(bin_dir)
    if out.exists():
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise BundleError(f"{out} holds files and no {MANIFEST}: not a bundle to replace; name another")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as work:
            if criu is not None:
                parts += criu_parts(criu, Path(work))
            entries: list[dict[str, Any]] = []
            for part in parts:
                xz = out / f"{part.name}.xz"
                _compress(part.source, xz)
                entries.append(
                    {
                        "name": part.name,
                        "xz": str(xz.relative_to(out)),
                        "size": part.source.stat().st_size,
                        "xz_size": xz.stat().st_size,
                        "sha256": _sha256(part.source),
                        "mode": stat.S_IMODE(part.source.stat().st_mode),
                    }
                )
        total = sum(int(e["xz_size"]) for e in entries)
        if total > budget_mib * MIB:
            raise BundleError(
                f"the bundle would be {total / MIB:.1f} MiB, over the {budget_mib:g} MiB budget; "
                f"largest: {_largest(entries)}"
            )
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "files": entries,
        "links": links,
        "criu": criu is not None,
        "size": sum(int(e["size"]) for e in entries),
        "xz_size": total,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _read_manifest(bundle: Path) -> dict[str, Any]:
    try:
        manifest: dict[str, Any] = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"{bundle / MANIFEST} cannot be read: {e}") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(
            f"{bundle / MANIFEST} is format {manifest.get('format')}, this unpacker reads {FORMAT}"
        )
    return manifest


def _inside(root: Path, name: str) -> Path:
    """``root / name``, its last component not followed (a link from an earlier unpack is replaced, not
    resolved); a name that leaves ``root`` is refused."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise BundleError(f"the manifest names {name!r}, outside the directory it unpacks into")
    return root.resolve() / rel


def _files(manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    files = manifest.get("files")
    if not isinstance(files, list):
        raise BundleError("the manifest lists no files")
    yield from files


def _unpack_file(bundle: Path, into: Path, entry: dict[str, Any]) -> None:
    name, size, digest = str(entry["name"]), int(entry["size"]), str(entry["sha256"])
    target = _inside(into, name)
    source = _inside(bundle, str(entry["xz"]))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.unpacking")
    h, written = hashlib.sha256(), 0
    try:
        with lzma.open(source, "rb") as src, tmp.open("wb") as dst:
            while block := src.read(CHUNK):
                h.update(block)
                written += len(block)
                dst.write(block)
    except (OSError, lzma.LZMAError) as e:
        tmp.unlink(missing_ok=True)
        raise BundleError(f"{source}: {e}") from None
    if (written, h.hexdigest()) != (size, digest):
        tmp.unlink(missing_ok=True)
        raise BundleError(
            f"{name}: {written} bytes with SHA-256 {h.hexdigest()}, "
            f"the manifest says {size} bytes with {digest}"
        )
    tmp.chmod(int(entry["mode"]))
    os.replace(tmp, target)


def unpack(bundle: Path, into: Path) -> dict[str, Any]:
    """Lay the bundle out in ``into``: the files (each checked), the links, and CRIU's wrapper."""
    manifest = _read_manifest(bundle)
    into.mkdir(parents=True, exist_ok=True)
    for entry in _files(manifest):
        _unpack_file(bundle, into, entry)
    links = manifest.get("links")
    for name, target in (links if isinstance(links, dict) else {}).items():
        link = _inside(into, name)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(target, link)
    if manifest.get("criu"):
        # The libraries CRIU links are not on the machine: its name in BIN runs it with them.
        wrapper = into / "criu"
        real = (into / CRIU_DIR).resolve()
        wrapper.unlink(missing_ok=True)
        wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={real}/lib exec {real}/criu "$@"\n')
        wrapper.chmod(0o755)
    return manifest


def _report(manifest: dict[str, Any]) -> str:
    lines = [
        f"  {e['name']:<28} {int(e['size']) / MIB:8.1f} MiB -> {int(e['xz_size']) / MIB:6.1f} MiB"
        for e in _files(manifest)
    ]
    lines.append(
        f"  {'total':<28} {int(manifest['size']) / MIB:8.1f} MiB -> "
        f"{int(manifest['xz_size']) / MIB:6.1f} MiB; links: {', '.join(sorted(manifest['links']))}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="compress the node's binaries into DIR")
    p.add_argument("dir", type=Path)
    p.add_argument("--bin", type=Path, default=None, help="the built binaries (default: the cache's bin)")
    p.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB)
    p.add_argument("--criu", type=Path, default=None, help="the CRIU build (default: BIN/criu)")
    p.add_argument("--no-criu", action="store_true", help="leave CRIU out")
    u = sub.add_parser("unpack", help="lay DIR's binaries out in BIN, checking each")
    u.add_argument("dir", type=Path)
    u.add_argument("--into", type=Path, default=None, help="where (default: the cache's bin)")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            bin_dir = args.bin or default_bin()
            criu = None if args.no_criu else (args.criu or bin_dir / "criu")
            manifest = pack(args.dir, bin_dir, args.budget_mib, criu)
            print(f"packed {args.dir}:\n{_report(manifest)}")
        else:
            into = args.into or default_bin()
            manifest = unpack(args.dir, into)
            print(f"unpacked {args.dir} into {into}:\n{_report(manifest)}")
    except BundleError as e:
        print(f"gpu_bundle: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
