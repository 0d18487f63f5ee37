"""Issue 43, no rank left behind: a failure injected on rank 1 into any method the plugin runs during a step
never leaves a collective with one rank in it (two CPU processes, gloo, every check on every step).

The methods are found by introspection (:mod:`tests.harness.injection`); the full sweep, every method at a
NaN step and at a healthy one in warn and skip modes, is ``benchmarks/fault_injection.py`` (figures in
docs/reliability.md). Here: the case of the issue and its two siblings, and the first part of the sweep in
each mode (one process pair per mode, the injections in sequence inside one fit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.injection import candidate_methods, event_entries, problems
from tests.harness.toolkit import read_report
from tests.integration.test_distributed import TIMEOUT_S, run_two_ranks

SWEEP_STEPS = 40


def test_the_injected_methods_are_found_by_introspection() -> None:
    """Every monitor class and the Run contribute; the Run's event entries are the gate and left out."""
    found = {f"{cls.__name__}.{name}" for cls, name in candidate_methods()}
    for expected in ("AnomalyMonitor.before_optimizer_step", "PerformanceMonitor._process",
                     "GradientMonitor.before_optimizer_step", "Run._emit", "Monitor.record", "MemoryMonitor.measure"):
        assert expected in found
    assert "before_optimizer_step" in event_entries() and "Run.before_optimizer_step" not in found
    assert len(found) > 100


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("method", ["AnomalyMonitor.before_optimizer_step", "PerformanceMonitor._process",
                                    "GradientMonitor.before_optimizer_step"])
def test_a_check_failing_on_rank_one_at_the_nan_step_keeps_both_ranks_together(tmp_path: Path, method: str) -> None:
    """The issue's case: skip mode, NaN on rank 1 at steps 4-6, ``method`` raises on rank 1 at step 4. Before, rank
    1 skipped the step's collectives (a hang with the anomaly check alone) or continued a step rank 0 skipped
    (different weights with all four callbacks). Both ranks now run every step, skip steps 4-6 together, end
    with the same weights, and rank 0's report lists the failed check on rank 1."""
    zero, one = run_two_ranks(tmp_path, "skip", 1, 4, "ddp", True, "basic", "--nan-last", "6",
                              "--inject", f"{method}@4", timeout_s=TIMEOUT_S)
    assert one["fired"] == [[method, 4]]
    assert problems([zero, one], 12) == []
    assert [d for d in zero["decisions"] if d[1] != "step"] == [[4, "skip"], [5, "skip"], [6, "skip"]]
    report = read_report(Path(zero["output_dir"]))
    planted = {name: entry for name, entry in report["failed_checks"].items()
               if any("planted failure" in reason for reason in entry["reasons"])}
    assert planted and all(entry["ranks"] == [1] and entry["first_step"] == 4 for entry in planted.values()), planted


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
    """One fit per mode: from step 2 on, one method found by introspection raises on rank 1 at each step, each
    at a healthy step and at a NaN step (skip: NaN on odd steps; warn: NaN once the healthy injections are
    done), in the order the methods were first called."""
    results = run_two_ranks(tmp_path, mode, 1, 3, "ddp", True, "basic", "--sweep", "--max-steps",
                            str(SWEEP_STEPS), timeout_s=TIMEOUT_S)
    assert problems(results, SWEEP_STEPS) == []
    assert len(results[1]["fired"]) >= SWEEP_STEPS // 2, results[1]["fired"]
    nan_steps = {step for step, decision in results[0]["decisions"] if decision != "step"} if mode == "skip" \
        else set(range(results[1]["nan_from"], SWEEP_STEPS))
    fired_steps = {step for _, step in results[1]["fired"]}
    assert fired_steps & nan_steps and fired_steps - nan_steps, "injections at NaN steps and at healthy ones"
