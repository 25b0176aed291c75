"""Selecting the host's files for an image: whole trees less what is skipped, never a compile cache or
another filesystem mounted inside; a path with the symlinks the loader follows to reach it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.host_trees import (
    HostFile,
    SelectionError,
    Tree,
    WalkReport,
    merge,
    path_chain,
    walk_tree,
)


def _paths(files: list[HostFile], root: Path) -> list[str]:
    prefix = str(root).lstrip("/")
    return [f.path.removeprefix(prefix).lstrip("/") for f in files if f.path.startswith(prefix)]


def test_walk_takes_the_tree_less_skips_caches_and_special_files(tmp_path: Path) -> None:
    root = tmp_path / "venv"
    for d in (
        "lib/pkg/__pycache__",
        "lib/pkg/sub",
        "share/doc/pkg",
        "torchinductor_root/fx",
        ".triton/cache",
    ):
        (root / d).mkdir(parents=True)
    for f in ("lib/pkg/__init__.py", "lib/pkg/__pycache__/x.pyc", "lib/pkg/sub/m.py", "share/doc/pkg/README"):
        (root / f).write_text("x")
    (root / "torchinductor_root" / "fx" / "kernel.py").write_text("cached")
    (root / "lib" / ".cache").mkdir()
    (root / "lib" / "link").symlink_to("pkg")
    os.mkfifo(root / "lib" / "fifo")
    report = WalkReport()
    files = merge(walk_tree(Tree(root, frozenset({"share/doc"})), report))
    rel = _paths(files, root)
    assert rel == [
        "",
        "lib",
        "lib/link",
        "lib/pkg",
        "lib/pkg/__init__.py",
        "lib/pkg/__pycache__",  # bytecode is part of the environment, not a compile cache
        "lib/pkg/__pycache__/x.pyc",
        "lib/pkg/sub",
        "lib/pkg/sub/m.py",
        "share",
    ]
    assert sorted(report.caches) == sorted(
        str(root / p) for p in (".triton", "torchinductor_root", "lib/.cache")
    )
    assert report.special == [str(root / "lib" / "fifo")]
    link = next(f for f in files if f.path.endswith("lib/link"))
    assert (link.kind, link.link) == ("link", "pkg")
    # Every directory above the tree is there too, so the layer creates them with the host's modes.
    assert files[0].path == str(tmp_path).lstrip("/").split("/")[0]


def test_walk_stays_on_the_trees_filesystem(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path / "usr"
    mounted = root / "local" / "nvidia"
    mounted.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("x")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True)
    try:
        (mounted / "libcuda.so.1").write_text("driver")
        report = WalkReport()
        rel = _paths(merge(walk_tree(Tree(root), report)), root)
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    assert rel == ["", "bin", "bin/tool", "local"]
    assert report.other_mounts == [str(mounted)]


def test_missing_tree_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SelectionError, match="is missing"):
        list(walk_tree(Tree(tmp_path / "nope")))


def test_path_chain_follows_each_link_to_the_file(tmp_path: Path) -> None:
    # A merged-/usr layout: /lib64 -> usr/lib64, and the loader's name a link to the versioned file.
    (tmp_path / "usr" / "lib" / "x86_64").mkdir(parents=True)
    (tmp_path / "usr" / "lib" / "x86_64" / "ld-2.so").write_text("loader")
    (tmp_path / "usr" / "lib64").mkdir()
    (tmp_path / "usr" / "lib64" / "ld.so.2").symlink_to("../lib/x86_64/ld-2.so")
    (tmp_path / "lib64").symlink_to("usr/lib64")
    chain = path_chain(str(tmp_path / "lib64" / "ld.so.2"))
    rel = {f.path.removeprefix(str(tmp_path).lstrip("/")).lstrip("/"): f.kind for f in chain}
    assert rel["lib64"] == "link"
    assert rel["usr/lib64/ld.so.2"] == "link"
    assert rel["usr/lib/x86_64/ld-2.so"] == "file"
    assert "lib64/ld.so.2" not in rel  # reached through the link, never stored under it
    with pytest.raises(SelectionError, match="is missing"):
        path_chain(str(tmp_path / "lib64" / "gone.so"))


def test_merge_keeps_the_first_of_each_path_and_refuses_files_under_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    first = HostFile(str(tmp_path / "real" / "f").lstrip("/"), "file", 0o600, 0, 0, size=1)
    merged = merge([first], walk_tree(Tree(tmp_path / "real")))
    assert [f for f in merged if f.path == first.path] == [first]
    (tmp_path / "alias").symlink_to("real")
    under_link = HostFile(str(tmp_path / "alias" / "f").lstrip("/"), "file", 0o644, 0, 0, size=1)
    with pytest.raises(SelectionError, match="not a directory"):
        merge([under_link])
