"""What the documents state about the code and the measurements, checked against the code and the results.

The layer drawing in docs/architecture.md names every package and module the import-linter contracts
layer (the files, not the contracts' own lists: a new module must be drawn); the README's headline
numbers are those of the results files under benchmarks/results they come from, rounded as printed; and
where a document says an agent flag is on or off by default, the agent's settings say so too.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.cli.settings_flags import setting_default, setting_names

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + len(heading) + 2)
    return text[start : end if end != -1 else len(text)]


def _drawn_names() -> set[str]:
    """Every identifier in the code blocks of the architecture document's "Layers" section."""
    blocks = re.findall(r"```\n(.*?)```", _section(REPO / "docs/architecture.md", "## Layers"), re.S)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(blocks)))


def _containers() -> list[str]:
    """The packages whose children the layers contracts place (each contract's containers)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = [
        c
        for contract in config["contracts"]
        if contract["type"] == "layers"
        for c in contract.get("containers", [])
    ]
    return sorted(set(found))


def _children(package: str) -> list[str]:
    directory = REPO.joinpath(*package.split("."))
    return sorted(
        p.stem if p.is_file() else p.name
        for p in directory.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    )


def test_the_contracts_layer_the_top_level_packages_and_the_two_largest() -> None:
    """The drawing test below covers what the contracts cover; these must be among it."""
    assert {"dynamo_snapshot", "dynamo_snapshot.agent", "dynamo_snapshot.controller"} <= set(_containers())


@pytest.mark.parametrize("container", _containers())
def test_the_layer_drawing_names_every_package_and_module(container: str) -> None:
    drawn = _drawn_names()
    missing = [child for child in _children(container) if child not in drawn]
    assert not missing, f"docs/architecture.md's layer drawing does not name {container}'s {missing}"


# --------------------------------------------------------------------------- README's numbers


def _results(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _readme_row(starts: str) -> str:
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(f"| {starts}")]
    assert len(rows) == 1, (starts, rows)
    return rows[0]


def _statements() -> dict[str, tuple[str, list[str]]]:
    """Per README table row (its first cell's start): the statements its results file makes of it."""
    scale = _results("controller-scale.json")
    failover = _results("failover.json")
    trace = _results("autoscale-trace.json")
    pods = _results("gpu-pod-1g-h100-g.json")
    process = _results("gpu-pod-1g-h100-g-process-baseline.json")["modes"]["decoupled"]
    kubelet = _results("kubelet-restore.json")
    peer = _results("vs-nvidia-snapshot.json")
    p50 = {(side, w): peer[side]["workloads"][w]["restore"]["p50_s"] for side in ("ours", "nvidia")
           for w in ("cpu-worker", "dynamo-mocker")}  # fmt: skip
    captured = {side: peer[side]["workloads"]["cpu-worker"]["checkpoint"] for side in ("ours", "nvidia")}
    cold = pods["cold"]["serving_s"]
    by_cache = {r["cache"]: r["serving_s"] for r in pods["restores"]}
    cached, dropped = by_cache["page"], by_cache["dropped"]
    return {
        "controller, 1,000 DGDs / 10,000 pods": (
            "controller-scale.json",
            [
                f"RSS {scale['rss_mib']:.0f} MiB",
                f"pod p95 {scale['scale_p95_s']:.2f} s",
                f"full resync {scale['details']['warm_resync']['full_pass_done_s']:.1f} s",
            ],
        ),
        "autoscaling by restore vs the HPA defaults": (
            "autoscale-trace.json",
            [
                f"{trace['ours']['sla_violation_s']} vs {trace['hpa']['sla_violation_s']} SLA-violation",
                f"at {trace['comparison']['gpu_hours_ratio_vs_hpa']:.2f}× the GPU-hours",
            ],
        ),
        "metric crossing → restore pod created": (
            "autoscale-trace.json",
            [f"p95 {trace['crossing_to_pod_p95_s']:.2f} s"],
        ),
        f"failure observed → replacement created ({failover['details']['all_created']['n']} losses)": (
            "failover.json",
            [
                f"p50 {failover['observed_to_created_p50_s']:.2f} s, "
                f"p95 {failover['observed_to_created_p95_s']:.2f} s"
            ],
        ),
        "the Qwen3-0.6B shape restored **into kubelet pods**": (
            "gpu-pod-1g-h100-g.json",
            [
                f"**{cached:.2f} s** pod seen → serving with the artifact in the page cache",
                f"({cold / cached:.1f}× the empty-cache cold pod's {cold:.1f} s)",
                f"**{dropped:.2f} s** from a dropped cache ({cold / dropped:.1f}×)",
                f"restores in {process['warm_restore']['restore_s']:.2f} s / {process['restore_s']:.2f} s",
            ],
        ),
        "beside NVIDIA's snapshot (its operator and agent": (
            "vs-nvidia-snapshot.json",
            [
                f"p50 **{p50['ours', 'cpu-worker']:.2f} s vs {p50['nvidia', 'cpu-worker']:.2f} s**",
                f"{p50['ours', 'dynamo-mocker']:.2f} s vs {p50['nvidia', 'dynamo-mocker']:.2f} s",
                f"Ready {captured['ours']['podsnapshot_created_to_ready_s']:.2f} s vs "
                f"{captured['nvidia']['podsnapshot_created_to_ready_s']:.2f} s",
            ],
        ),
        "restore into the restore pod's own container on a kubelet node": (
            "kubelet-restore.json",
            [f"restore pod → serving p50 {kubelet['total_s']['p50']:.2f} s"],
        ),
    }


@pytest.mark.parametrize("row", list(_statements()))
def test_the_readme_numbers_are_the_results_files(row: str) -> None:
    source, statements = _statements()[row]
    text = _readme_row(row)
    missing = [s for s in statements if s not in text]
    assert not missing, f"README's row {row!r} does not say what {source} measured: {missing}"


def test_the_kwok_demo_run_is_its_summary() -> None:
    summary = _results("demo-summary.json")["results"]
    restores = summary["restore_s"]
    failover = summary["failover_s"]
    stated = f"restores of {min(restores):.2f}–{max(restores):.2f} s and a failover of {failover:.2f} s"
    assert stated in " ".join((REPO / "README.md").read_text().split())


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return float(found.group(1))


def test_the_demo_speedup_stated_is_its_tables() -> None:
    """The ratio under the demo's table is the table's cold start over its restore p50."""
    cold = _number(r"\| ([0-9.]+) s \|", _readme_row("cold start (pod created → worker serving)"))
    restore = _number(r"p50 ([0-9.]+) s", _readme_row("restore (pod created → worker serving)"))
    text = " ".join((REPO / "README.md").read_text().split())
    stated = re.findall(
        r"so the ([0-9.]+)× above \(a cold start of ([0-9.]+) s against a restore p50 of ([0-9.]+) s\)", text
    )
    assert stated == [(f"{cold / restore:.1f}", f"{cold:.2f}", f"{restore:.2f}")]


# --------------------------------------------------------------------------- defaults the documents state

# "`--compress-pages`, off by default", "with `--drop-zero-pages` (off by default)": a flag and, before the
# sentence or clause ends, whether it is on (or auto, for a setting whose default decides by itself).
DEFAULT_STATEMENT = re.compile(r"`--([a-z][a-z-]*)`[^.;`]{0,40}?\b(on|off|auto) by default")
DOCUMENTS = ("README.md", "BENCHMARKS.md", "agent/README.md", "controller/README.md", "docs/*.md")


def _default_statements() -> list[tuple[str, str, str]]:
    found = []
    for pattern in DOCUMENTS:
        for path in sorted(REPO.glob(pattern)):
            text = " ".join(path.read_text().split())
            found += [
                (path.relative_to(REPO).as_posix(), m[1], m[2]) for m in DEFAULT_STATEMENT.finditer(text)
            ]
    return found


def test_the_documents_state_agent_defaults() -> None:
    """The rule below has statements to check: the compressed pages and the zero-page rewrite, at least."""
    flags = {flag for _, flag, _ in _default_statements()}
    assert {"compress-pages", "drop-zero-pages"} <= flags, flags


@pytest.mark.parametrize(("document", "flag", "state"), _default_statements())
def test_a_default_the_documents_state_is_the_agents(document: str, flag: str, state: str) -> None:
    name = flag.replace("-", "_")
    assert name in setting_names(), f"{document} names --{flag}, which the agent does not have"
    default = setting_default(name)
    said = f"{document} says --{flag} is {state} by default; the agent: {default}"
    if "auto" in (state, default):
        assert state == default, said
        return
    # A setting unset by default (the node cache's root) is off; one with a value of its own is on.
    on = default not in (None, "off")
    assert on == (state == "on"), said
