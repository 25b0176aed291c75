"""Which source files each image carries, read from the distributions' pyproject files.

The repository builds three distributions from one source tree: the worker SDK (sdk/pyproject.toml: the
files its wheel's build hook, hatch_sources.py, takes from its `sources` table), the product
(pyproject.toml: the rest of `dynamo_snapshot`, depending on the SDK) and the dev harness
(dev/pyproject.toml: `dynamo_snapshot_dev`). The images built here copy sources instead of installing
wheels, so they take the same lists: a worker image the SDK's files, the controller and agent images the
product's and the SDK's (`dynamo_snapshot` whole), none of them the dev harness.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

SDK_PYPROJECT = Path("sdk/pyproject.toml")
PACKAGE = "dynamo_snapshot"


class DistributionError(Exception):
    """A pyproject file names sources this checkout does not have."""


def _wheel_sources(repo: Path, pyproject: Path) -> dict[str, str]:
    path = repo / pyproject
    try:
        data = tomllib.loads(path.read_text())
        table: dict[str, str] = data["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"][
            "sources"
        ]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as e:
        raise DistributionError(f"{path}: no wheel sources table to read ({e})") from None
    return table


def sdk_files(repo: Path) -> list[tuple[Path, str]]:
    """(source file, its path in site-packages) for every file of the worker SDK's wheel, in path order;
    bytecode caches left out, as the wheel leaves them."""
    found: list[tuple[Path, str]] = []
    for src, dest in _wheel_sources(repo, SDK_PYPROJECT).items():
        path = (repo / SDK_PYPROJECT.parent / src).resolve()
        if path.is_file():
            found.append((path, dest))
        elif path.is_dir():
            found += [
                (f, f"{dest}/{f.relative_to(path).as_posix()}")
                for f in path.rglob("*")
                if f.is_file() and "__pycache__" not in f.relative_to(path).parts
            ]
        else:
            raise DistributionError(f"{SDK_PYPROJECT} names {src}, which {repo} does not have")
    return sorted(found, key=lambda pair: pair[1])
