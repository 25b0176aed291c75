"""The demo's ending: a table of what was measured and a plot of load and replicas over time."""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.table import Table

from dynamo_snapshot_dev.demo.scenario import Results
from dynamo_snapshot_dev.demo.traffic import Timeline


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def speedup(cold_start_s: float, restore_s: float) -> str:
    """Says which was faster: on a slow machine a tiny worker's restore can lose, and the table must not
    call that a speed-up."""
    ratio = cold_start_s / restore_s
    return f"{ratio:.1f}× faster" if ratio >= 1 else f"{1 / ratio:.1f}× slower"


def table(r: Results) -> Table:
    t = Table(title="dynamo-snapshot demo: measured on this machine", title_justify="left")
    t.add_column("what")
    t.add_column("measured", justify="right")
    t.add_row("cold start (pod created → worker serving)", _seconds(r.cold_start_s))
    t.add_row("checkpoint (DGD applied → checkpoint Ready)", _seconds(r.checkpoint_s))
    if r.artifact_mib is not None:
        t.add_row("artifact size", f"{r.artifact_mib:.0f} MiB")
    if r.restore_s:
        t.add_row(
            f"restore (pod created → worker serving), {len(r.restore_s)} pods",
            f"p50 {statistics.median(r.restore_s):.2f} s, max {max(r.restore_s):.2f} s",
        )
    for phase, seconds in sorted(r.restore_phases.items()):
        t.add_row(f"  agent phase {phase} (median)", _seconds(seconds))
    t.add_row("failover (worker killed → restored replacement serving)", _seconds(r.failover_s))
    if r.cold_start_s and r.restore_s:
        t.add_row("restore vs cold start", speedup(r.cold_start_s, statistics.median(r.restore_s)))
    t.add_row("scaled up to / back down to", f"{r.scaled_to or '-'} / {r.scaled_down_to or '-'} replicas")
    t.add_row("requests served / failed", f"{r.requests_ok} / {r.requests_failed}")
    return t


def plot(timeline: Timeline, path: Path) -> str | None:
    """Write the PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the dev harness's requirement: pip install -e ./dev) — no plot"
    s = timeline.samples
    t = [x.t for x in s]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot(t, [x.offered_rps for x in s], label="offered load (req/s)")
    ax1.plot(t, [x.in_flight for x in s], label="requests in flight")
    ax1.set_ylabel("requests")
    ax1.legend(loc="upper left")
    ax2.step(t, [x.desired for x in s], where="post", label="replicas asked for")
    ax2.step(t, [x.serving for x in s], where="post", label="replicas serving")
    ax2.set_ylabel("replicas")
    ax2.set_xlabel("seconds since the DGD was applied")
    ax2.legend(loc="upper left")
    for when, what in timeline.marks:
        for ax in (ax1, ax2):
            ax.axvline(when, color="grey", linewidth=0.5, linestyle=":")
        ax2.annotate(what, (when, 0), rotation=90, fontsize=7, va="bottom", ha="right")
    fig.suptitle("dynamo-snapshot demo: load and replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
