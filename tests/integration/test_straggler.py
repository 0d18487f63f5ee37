"""Two CPU processes (gloo), all four callbacks, TensorBoard, every check every step: rank 0 does all
the logging and writing and is no straggler, nor is rank 1 that waits for it (Lightning's row written on
every step, ``log_every_n_steps=1``); a rank that sleeps in every step is named."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.toolkit import child_env, read_events, read_report, run_children

WORKER = Path(__file__).resolve().parents[1] / "workers" / "straggler_worker.py"
TIMEOUT_S = 150


def run_two_ranks(tmp_path: Path, sleep_rank: int, sleep_ms: float, log_every_n_steps: int = 50
                  ) -> list[dict[str, Any]]:
    completed = run_children([sys.executable, str(WORKER), str(tmp_path), str(sleep_rank), str(sleep_ms),
                              str(log_every_n_steps)], TIMEOUT_S, tmp_path, child_env(PYTHONWARNINGS="ignore"))
    log_dir = tmp_path / "log_dir.txt"
    assert completed.returncode == 0 and log_dir.exists(), completed.stdout[-3000:]
    return read_events(Path(log_dir.read_text()) / "debug_outputs")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_healthy_ddp_run_with_all_four_and_tensorboard_names_no_straggler(tmp_path: Path) -> None:
    events = run_two_ranks(tmp_path, sleep_rank=-1, sleep_ms=0)
    assert [e["message"] for e in events if e["kind"] == "straggler_rank"] == []
    timing = {"slow_step", "dataloader_bottleneck", "straggler_rank"}  # other areas are judged in their own tests
    loud = [e for e in events if e["kind"] in timing and e["severity"] in ("warning", "error", "critical")]
    assert loud == [], [e["message"] for e in loud]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_healthy_ddp_run_logging_every_step_names_no_straggler(tmp_path: Path) -> None:
    """Rank 0 writes Lightning's row of debug scalars on every step; rank 1 waits for it before the all-reduce
    (its data wait was 20 ms longer on every step) and was named the straggler before the rule asked whether
    the others wait for it in the all-reduce."""
    events = run_two_ranks(tmp_path, sleep_rank=-1, sleep_ms=0, log_every_n_steps=1)
    assert [e["message"] for e in events if e["kind"] == "straggler_rank"] == []
    report = read_report(Path((tmp_path / "log_dir.txt").read_text()) / "debug_outputs")
    assert report["status"] == "finished" and "straggler_rank" not in report["findings"]
    # every step but the one the activation verdicts hook (one forward per 100 steps, never timed)
    assert report["sections"]["performance"]["plugin_time_ms"]["count"] == 29, "every other step was timed"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_rank_that_sleeps_every_step_is_the_straggler(tmp_path: Path) -> None:
    events = run_two_ranks(tmp_path, sleep_rank=1, sleep_ms=60)
    stragglers = [e for e in events if e["kind"] == "straggler_rank" and e.get("episode") == "start"]
    assert stragglers, [(e["kind"], e["message"][:200]) for e in events]
    assert stragglers[0]["details"]["rank"] == 1 and "Rank 1" in stragglers[0]["message"]
    mine, other = stragglers[0]["details"]["median_before_sync_ms_by_rank"][1], \
        stragglers[0]["details"]["median_before_sync_ms_by_rank"][0]
    assert mine - other >= 50
    assert stragglers[0]["details"]["median_wait_ms"] >= 50, "rank 0 waits for it in the all-reduce"
