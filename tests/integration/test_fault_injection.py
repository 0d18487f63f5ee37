"""Issue 43, no rank left behind: a failure injected on rank 1 into any method the plugin runs during a step
never leaves a collective with one rank in it (two CPU processes, gloo, every check on every step).

The methods are found by introspection (:mod:`tests.harness.injection`); the full sweep, every method at each
kind of step it runs at (NaN, healthy) in warn and skip modes, is ``benchmarks/fault_injection.py`` (figures in
docs/reliability.md). Here: the case of the issue and its two siblings in one fit, and the first part of the
sweep in each mode (one process pair per mode, the injections in sequence inside one fit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.injection import candidate_methods, coverage, event_entries, leftovers, problems
from tests.harness.toolkit import read_report
from tests.integration.test_distributed import TIMEOUT_S, run_two_ranks

SWEEP_STEPS = 40
ISSUE_METHODS = ["AnomalyMonitor.before_optimizer_step", "PerformanceMonitor._process",
                 "GradientMonitor.before_optimizer_step"]


def test_the_injected_methods_are_found_by_introspection() -> None:
    """Every monitor class and the Run contribute; the Run's event entries are the gate and left out."""
    found = {f"{cls.__name__}.{name}" for cls, name in candidate_methods()}
    for expected in (*ISSUE_METHODS, "Run._emit", "Monitor.record", "MemoryMonitor.measure"):
        assert expected in found
    assert "before_optimizer_step" in event_entries() and "Run.before_optimizer_step" not in found
    assert len(found) > 100


def test_a_method_never_called_at_a_kind_of_step_is_not_applicable_there() -> None:
    """Derived from the steps each method ran at: ``undo_step`` runs on dropped (NaN) steps only."""
    calls = {"AnomalyMonitor.undo_step": [3, 5], "Monitor.due": [2, 3, 4, 5], "Run._emit": [2, 4]}
    fired = [("Monitor.due", 2), ("AnomalyMonitor.undo_step", 3), ("Monitor.due", 5)]
    result = coverage([(calls, fired, {3, 5})])
    assert result["methods"] == 3
    assert result["healthy"] == {"applicable": 2, "injected": 1, "not_applicable": ["AnomalyMonitor.undo_step"],
                                 "not_reached": ["Run._emit"]}
    assert result["nan"] == {"applicable": 2, "injected": 2, "not_applicable": ["Run._emit"], "not_reached": []}
    assert leftovers(result, [(calls, fired, {3, 5})]) == [
        ("Run._emit", False, [2, 4]), ("AnomalyMonitor.undo_step", False, []), ("Run._emit", True, [])]
    # a second fit that calls Run._emit at a NaN step and injects it at a healthy one: the union of the two
    again = coverage([(calls, fired, {3, 5}), ({"Run._emit": [6, 7]}, [("Run._emit", 6)], {7})])
    assert again["healthy"]["not_reached"] == [] and again["nan"]["not_reached"] == ["Run._emit"]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_check_failing_on_rank_one_at_the_nan_step_keeps_both_ranks_together(tmp_path: Path) -> None:
    """The issue's case: skip mode, NaN on rank 1 at steps 4-6, ``AnomalyMonitor.before_optimizer_step`` raises on
    rank 1 at step 4, and its two siblings at the next NaN steps. Before, rank 1 skipped the step's collectives
    (a hang with the anomaly check alone) or continued a step rank 0 skipped (different weights with all four
    callbacks). Both ranks now run every step, skip steps 4-6 together, end with the same weights, and rank 0's
    report lists each failed check on rank 1 at its step."""
    injections = [f"{method}@{step}" for step, method in enumerate(ISSUE_METHODS, start=4)]
    zero, one = run_two_ranks(tmp_path, "skip", 1, 4, "ddp", True, "basic", "--nan-last", "6",
                              *[arg for spec in injections for arg in ("--inject", spec)], timeout_s=TIMEOUT_S)
    assert one["fired"] == [[method, step] for step, method in enumerate(ISSUE_METHODS, start=4)]
    assert problems([zero, one], 12) == []
    assert [d for d in zero["decisions"] if d[1] != "step"] == [[4, "skip"], [5, "skip"], [6, "skip"]]
    report = read_report(Path(zero["output_dir"]))
    planted = {name: entry for name, entry in report["failed_checks"].items()
               if any("planted failure" in reason for reason in entry["reasons"])}
    assert planted and all(entry["ranks"] == [1] for entry in planted.values()), planted
    first_steps = sorted(entry["first_step"] for entry in planted.values())
    assert first_steps[0] == 4 and set(first_steps) <= {4, 5, 6}, planted


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_issue_case_with_the_anomaly_check_alone_does_not_hang(tmp_path: Path) -> None:
    """With only AnomalyDetectionCallback, rank 1 made no collective at all at step 4: both ranks hung."""
    zero, one = run_two_ranks(tmp_path, "skip", 1, 4, "ddp", False, "basic", "--nan-last", "6",
                              "--inject", "AnomalyMonitor.before_optimizer_step@4", timeout_s=TIMEOUT_S)
    assert problems([zero, one], 12) == []
    assert zero["decisions"][4] == one["decisions"][4] == [4, "skip"]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("mode", ["warn", "skip"])
def test_the_first_injections_of_the_sweep_hold_in_one_fit(tmp_path: Path, mode: str) -> None:
    """One fit per mode: from step 0 on, one method found by introspection raises on rank 1 at each step, each
    at the kinds of step it runs at (skip: NaN on odd steps, epochs of 7 batches; warn: NaN once the healthy
    injections are done or from half the fit), the methods expected at the step first."""
    results = run_two_ranks(tmp_path, mode, 1, 3, "ddp", True, "basic", "--sweep", "--max-steps",
                            str(SWEEP_STEPS), timeout_s=TIMEOUT_S)
    assert problems(results, SWEEP_STEPS) == []
    fired, covered = results[1]["fired"], results[1]["coverage"]
    assert len(fired) >= SWEEP_STEPS * 3 // 4, fired  # about one a step
    assert covered["methods"] > 40, covered  # the methods called during a step on rank 1
    assert covered["healthy"]["injected"] >= 10 and covered["nan"]["injected"] >= 10, covered
