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
    kwok: Path
    helm: Path
    criu: Path
    kwok_stages: Path

    @property
    def bin_dir(self) -> Path:
        return self.kubectl.parent


def find_components(bin_dir: Path | None = None) -> Components:
    """Locate every binary, or raise one error that names all missing ones and the fix."""
    base = bin_dir or cache_dir() / "bin"
    names = {
        "etcd": "etcd",
        "kube_apiserver": "kube-apiserver",
        "kube_scheduler": "kube-scheduler",
        "kube_controller_manager": "kube-controller-manager",
        "kubectl": "kubectl",
        "kwok": "kwok",
        "helm": "helm",
        "criu": "criu",
    }
    paths = {attr: base / exe for attr, exe in names.items()}
    missing = [names[a] for a, p in paths.items() if not os.access(p, os.X_OK)]
    paths["kwok_stages"] = base / "kwok-stages.yaml"
    if not paths["kwok_stages"].is_file():
        missing.append("kwok-stages.yaml")
    if missing:
        raise ComponentsMissingError(f"missing in {base}: {', '.join(missing)} — {SETUP_HINT}")
    return Components(**paths)
