"""Hatchling build hook of sdk/pyproject.toml and dev/pyproject.toml: their wheels' files come from the
repository's one source tree, outside their own directories.

The hook's `sources` table maps each file or directory (relative to the pyproject's directory) to its path
in the wheel. Only a standard wheel copies them; an editable install puts the repository root on the path
instead (`dev-mode-dirs`), so the working tree is what every distribution imports.
"""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class SourcesHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update(self.config["sources"])
