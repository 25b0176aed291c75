"""The GPU side-by-side table (benchmarks/gpu/compare_vs_nvidia.py): which restores each side's numbers come
from, what counts as a failure, and the ratios."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.compare_vs_nvidia import compare


def _restore(seconds: float, *, right: bool = True, cpu: float = 0.1) -> dict[str, Any]:
    first = seconds + 0.05
    return {"restore_s": seconds, "first_token_s": first, "output_identical": right, "cpu_all_s": cpu}


def _bench() -> dict[str, Any]:
    plain = {
        **_restore(4.0),
        "cold_start_s": 90.0,
        "checkpoint_s": 6.0,
        "checkpoint_cpu_all_s": 1.0,
        "artifact_bytes": 2_000_000_000,
        "warm_restore": _restore(2.0),
        "diagnostics": {
            "default": _restore(5.0),
            "default#2": _restore(3.0),
            "default#3": {"error": "Traceback ... TimeoutError"},
            "warm_node": _restore(1.0),
            "weights_after": _restore(0.5),  # another variant: neither side of the table
        },
    }
    decoupled = {**_restore(9.0, right=False), "checkpoint_s": 3.0, "artifact_bytes": 1_000_000_000}
    modes = {"plain": plain, "decoupled": decoupled}
    return {"size": "1g", "kv_gib": 8.0, "storage_gbps": 2.0, "modes": modes}


def _nvidia() -> dict[str, Any]:
    return {
        "criu": "4.2",
        "storage_gbps": 2.1,
        "cold_start_s": 30.0,
        "checkpoint_s": 12.0,
        "checkpoint_cpu_all_s": 2.0,
        "artifact_bytes": 10_000_000_000,
        "restores": [
            {**_restore(8.0), "cache": "dropped"},
            {**_restore(6.0), "cache": "dropped"},
            {**_restore(7.0), "cache": "dropped"},
            {**_restore(4.0), "cache": "warm"},
        ],
    }


def test_each_side_takes_its_dropped_and_warm_restores_and_counts_failures() -> None:
    out = compare([_bench()], _nvidia())
    plain = out["ours"]["plain"]
    assert plain["cache_dropped"]["restore_s"] == {"n": 3, "p50": 4.0, "p95": 5.0}
    assert plain["cache_dropped"]["failures"] == 1  # the diagnostics restore that raised
    assert plain["cache_warm"]["restore_s"] == {"n": 2, "p50": 1.5, "p95": 2.0}
    assert out["theirs"]["cache_dropped"]["restore_s"] == {"n": 3, "p50": 7.0, "p95": 8.0}
    assert out["theirs"]["cache_warm"]["restore_s"] == {"n": 1, "p50": 4.0, "p95": 4.0}


def test_a_wrong_answer_is_a_failure_not_a_time() -> None:
    decoupled = compare([_bench()], _nvidia())["ours"]["decoupled"]
    assert decoupled["cache_dropped"]["restore_s"] is None
    assert decoupled["cache_dropped"]["failures"] == 1


def test_ratios_are_ours_over_theirs() -> None:
    ratios = compare([_bench()], _nvidia())["ours_over_theirs"]
    assert ratios["plain"]["checkpoint_s"] == 0.5
    assert ratios["plain"]["artifact_bytes"] == 0.2
    assert ratios["plain"]["cache_dropped.restore_s.p50"] == round(4.0 / 7.0, 3)
    assert ratios["plain"]["cache_warm.restore_s.p95"] == 0.5
    assert ratios["plain"]["checkpoint_cpu_all_s"] == 0.5
    assert ratios["decoupled"]["cache_dropped.restore_s.p50"] is None  # nothing served right: no ratio


def test_runs_without_the_whole_cpu_count_get_no_cpu_ratio() -> None:
    bench, nvidia = _bench(), _nvidia()
    for rec in nvidia["restores"]:
        rec["cpu_s"] = rec.pop("cpu_all_s")  # counted the older way
    ratios = compare([bench], nvidia)["ours_over_theirs"]["plain"]
    assert ratios["cache_dropped.cpu_all_s.p50"] is None
    assert ratios["cache_dropped.restore_s.p50"] is not None


def test_modes_of_several_calls_go_together_each_with_its_disk() -> None:
    first, second = _bench(), _bench()
    del first["modes"]["decoupled"]
    second["storage_gbps"] = 1.5
    second["modes"] = {"decoupled": {**second["modes"]["decoupled"], **_restore(3.0)}}
    ours = compare([first, second], _nvidia())["ours"]
    assert (ours["plain"]["storage_gbps"], ours["decoupled"]["storage_gbps"]) == (2.0, 1.5)
    assert ours["decoupled"]["cache_dropped"]["restore_s"] == {"n": 1, "p50": 3.0, "p95": 3.0}
