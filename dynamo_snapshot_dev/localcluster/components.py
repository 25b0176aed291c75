"""Where the control-plane binaries live and how to tell the user when they are missing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DYNSNAP_CACHE"
SETUP_HINT = "run scripts/test-env.sh (as root) to build and cache them"


class ComponentsMissingError(RuntimeError):
    """One or more binaries are not in the cache; the message says how to get them."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dynamo-snapshot")


@dataclass(frozen=True)
class Components:
    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubectl: Path
    # kwok (with its stages) and helm are optional where asked for so: None when the bin dir lacks them.
    kwok: Path | None
    helm: Path | None
    criu: Path
    kwok_stages: Path | None

    @property
    def bin_dir(self) -> Path:
        return self.kubectl.parent


def find_components(bin_dir: Path | None = None, *, kwok: bool = True, helm: bool = True) -> Components:
    """Locate every binary, or raise one error that names all missing ones and the fix.

    ``kwok=False`` / ``helm=False``: those are taken where present and otherwise left out (None), as on a
    machine that runs the control plane and a real node only. A kwok without its stages file is refused.
    """
    base = bin_dir or cache_dir() / "bin"
    missing: list[str] = []

    def look(name: str, *, required: bool = True) -> Path | None:
        path = base / name
        ok = path.is_file() if name.endswith(".yaml") else os.access(path, os.X_OK)
        if not ok and required:
            missing.append(name)
        return path if ok else None

    for name in ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl"):
        look(name)
    kwok_bin = look("kwok", required=kwok)
    helm_bin = look("helm", required=helm)
    look("criu")
    stages = look("kwok-stages.yaml", required=kwok or kwok_bin is not None)
    if missing:
        raise ComponentsMissingError(f"missing in {base}: {', '.join(missing)} — {SETUP_HINT}")
    return Components(
        etcd=base / "etcd",
        kube_apiserver=base / "kube-apiserver",
        kube_scheduler=base / "kube-scheduler",
        kube_controller_manager=base / "kube-controller-manager",
        kubectl=base / "kubectl",
        kwok=kwok_bin,
        helm=helm_bin,
        criu=base / "criu",
        kwok_stages=stages,
    )
