"""The demo's table says what was measured, including a restore that lost to the cold start."""

from __future__ import annotations

from rich.console import Console

from dynamo_snapshot_dev.demo.report import speedup, table
from dynamo_snapshot_dev.demo.scenario import Results


def test_a_faster_restore_is_called_faster_and_a_slower_one_slower() -> None:
    assert speedup(6.0, 2.0) == "3.0× faster"
    assert speedup(2.0, 2.0) == "1.0× faster"
    assert speedup(1.72, 1.83) == "1.1× slower"


def test_the_table_compares_the_cold_start_with_the_median_restore() -> None:
    r = Results(cold_start_s=1.5, restore_s=[1.0, 3.0, 2.0])
    console = Console(width=200, record=True)
    console.print(table(r))
    text = console.export_text()
    assert "p50 2.00 s, max 3.00 s" in text
    assert "1.3× slower" in text
