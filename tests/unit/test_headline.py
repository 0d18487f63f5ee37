"""The console headline counts findings of severity warning and above; info-level ones are notes (issue 26)."""

from __future__ import annotations

from lightning_debug.report.summary import _headline


def _report(**severities: str) -> dict:
    return {"status": "finished", "last_step": 30, "failed_checks": {},
            "findings": {kind: {"severity": severity} for kind, severity in severities.items()}}


def test_an_info_finding_alone_is_a_note_not_something_wrong() -> None:
    headline = _headline(_report(profiler_trace="info"))
    assert headline == "lightning-debug: run finished at step 30, nothing wrong found (1 note(s))"


def test_warnings_and_above_are_counted_and_notes_named_apart() -> None:
    headline = _headline(_report(nonfinite_loss="error", slow_step="warning", weight_decay_on_norm="info"))
    assert headline == "lightning-debug: run finished at step 30, 2 kind(s) of finding and 1 note(s)"
    assert _headline(_report()) == "lightning-debug: run finished at step 30, nothing wrong found"
