"""The Restored condition read as NVIDIA Snapshot's restore-pod contract reads it, and the skip-compat-check
annotation read as its Go reader (strconv.ParseBool) does."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_outcome import RestoreOutcome, classify_restore_outcome, skip_compat_check

Outcome = RestoreOutcome


def _restored(status: str, reason: str = "") -> list[dict[str, Any]]:
    return [
        {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
        {"type": protocol.POD_CONDITION_RESTORED, "status": status, "reason": reason},
    ]


@pytest.mark.parametrize(
    ("status", "reason", "outcome"),
    [
        ("True", "RestoreSucceeded", Outcome.SUCCEEDED),
        ("True", "", Outcome.SUCCEEDED),
        ("False", "RestoreFailed", Outcome.FAILED),
        ("False", "RestoreIncompatible", Outcome.FAILED),
        ("False", "RestoreReplenishmentIncompatible", Outcome.FAILED),
        ("False", "RestorePartiallySucceeded", Outcome.PARTIALLY_SUCCEEDED),
        ("False", "RestoreInProgress", Outcome.PENDING),
        ("False", "RestoreReplenishing", Outcome.PENDING),
        ("False", "RestoreRefused", Outcome.UNKNOWN),  # no reason of the contract's: the reader decides
        ("Unknown", "RestoreInProgress", Outcome.UNKNOWN),
    ],
)
def test_each_reason_of_the_contract(status: str, reason: str, outcome: RestoreOutcome) -> None:
    assert classify_restore_outcome(_restored(status, reason)) is outcome


def test_no_condition_is_pending_and_only_outcomes_are_terminal() -> None:
    assert classify_restore_outcome(None) is Outcome.PENDING
    assert classify_restore_outcome([{"type": "Ready", "status": "True"}]) is Outcome.PENDING
    assert {o for o in Outcome if o.terminal} == {
        Outcome.SUCCEEDED,
        Outcome.FAILED,
        Outcome.PARTIALLY_SUCCEEDED,
    }


def test_every_reason_the_agent_writes_is_classified() -> None:
    for reason in protocol.RestoredReason:
        status = "True" if reason is protocol.RestoredReason.SUCCEEDED else "False"
        assert classify_restore_outcome(_restored(status, reason.value)) is not Outcome.UNKNOWN, reason


@pytest.mark.parametrize("value", ["true", "True", "TRUE", "t", "T", "1", " true "])
def test_skip_compat_check_true_as_go_reads_it(value: str) -> None:
    assert skip_compat_check({protocol.ANNOTATION_SKIP_COMPAT_CHECK: value})


@pytest.mark.parametrize("value", ["yes", "on", "y", "tRUE", "", "false", "0", "2"])
def test_any_other_spelling_keeps_the_checks(value: str) -> None:
    assert not skip_compat_check({protocol.ANNOTATION_SKIP_COMPAT_CHECK: value})
    assert not skip_compat_check({})
    assert not skip_compat_check(None)
