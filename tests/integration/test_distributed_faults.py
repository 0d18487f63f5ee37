"""Two CPU processes (gloo), issue 27: no failure on one rank desynchronises the plugin's collectives, a check
that fails on rank 1 is in rank 0's report, and a replay never runs the user's collectives on one rank only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.toolkit import read_events, read_report
from tests.integration.test_distributed import TIMEOUT_S, run_two_ranks

FAULTS = [  # place, mode, level, nan rank, nan step, all four callbacks, extra worker flags, the failed check's name
    ("replay", "warn", "advanced", 1, 4, False, [], "replaying the step"),
    ("rows", "skip", "basic", 1, 5, False, ["--nan-batch"], "naming the non-finite samples"),
    ("origin", "warn", "advanced", 1, 4, False, ["--nan-in-backward"], "tracing the non-finite weights"),
    ("performance", "warn", "basic", -1, 4, True, [], "PerformanceMonitor.batch_end"),
]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize(("place", "mode", "level", "nan_rank", "nan_step", "all_four", "extra", "check"), FAULTS,
                         ids=[fault[0] for fault in FAULTS])
def test_a_failure_on_rank_one_keeps_the_collectives_together_and_reaches_rank_zeros_report(
        tmp_path: Path, place: str, mode: str, level: str, nan_rank: int, nan_step: int, all_four: bool,
        extra: list[str], check: str) -> None:
    """Rank 1 raises inside the replay, while naming the non-finite samples, while tracing non-finite weights or
    in the performance rules before the straggler gather: both ranks finish, enter the same collectives at
    the same steps, take the same decisions, and rank 0's report lists the failed check with its rank."""
    results = run_two_ranks(tmp_path, mode, nan_rank, nan_step, "ddp", all_four, level, *extra, "--fail-rank1", place)
    zero, one = results
    assert zero["exception"] is None and one["exception"] is None, (zero, one)
    assert zero["global_step"] == one["global_step"] == 12
    assert zero["gather_steps"] == one["gather_steps"] and zero["gather_steps"]
    assert zero["decisions"] == one["decisions"]
    assert zero["param_checksum"] == pytest.approx(one["param_checksum"], rel=1e-9, nan_ok=True)
    assert check in one["failed_checks"], one["failed_checks"]
    assert check in zero["failed_checks"], "a check that fails on rank 1 is in rank 0's report"
    report = read_report(Path(zero["output_dir"]))
    entry = report["failed_checks"][check]
    assert entry["ranks"] == [1] and all(reason.startswith("on rank 1: ") for reason in entry["reasons"])
    assert "nothing wrong found" not in (Path(zero["output_dir"]) / "report.md").read_text().lower()
    if mode == "skip":
        assert zero["decisions"][nan_step] == [nan_step, "skip"]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_nan_in_the_backward_with_a_sync_grads_gather_in_training_step_does_not_hang(tmp_path: Path) -> None:
    """``self.all_gather(z, sync_grads=True)`` in ``training_step`` and a NaN that only the backward makes, on
    rank 1, at ADVANCED in warn mode: a backward replay would stop at the NaN on rank 1 while rank 0 enters the
    gather's backward. The forward replay sees the collective, so no rank replays the backward, and the
    cause says so; both ranks finish."""
    results = run_two_ranks(tmp_path, "warn", 1, 4, "ddp", False, "advanced", "--gather-in-step", "--sync-grads",
                            "--nan-in-backward")
    zero, one = results
    assert zero["exception"] is None and one["exception"] is None
    assert zero["global_step"] == one["global_step"] == 12
    assert zero["gather_steps"] == one["gather_steps"]
    events = read_events(Path(zero["output_dir"]))
    grads = next(e for e in events if e["kind"] == "nonfinite_grad" and e.get("episode") == "start")
    assert grads["step"] == 4
    cause = grads["details"]["cause"]
    assert cause["where"] == "not_reproduced" and "the backward was not replayed" in cause["summary"], cause
    assert "c10d.allgather_" in cause["summary"] and cause["outputs"]["collectives"] == ["c10d.allgather_"]
