"""Two CPU processes (gloo): every rank takes the same decision at the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.toolkit import read_events

WORKER = Path(__file__).with_name("ddp_worker.py")
TIMEOUT_S = 150


def run_two_ranks(tmp_path: Path, mode: str, nan_rank: int = 1, nan_step: int = 4) -> list[dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    completed = subprocess.run([sys.executable, str(WORKER), mode, str(tmp_path), str(nan_rank), str(nan_step)],
                               capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert len(results) == 2, f"both ranks must finish; stderr:\n{completed.stderr[-3000:]}"
    return results


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_stop_on_rank_one_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "stop")
    assert [r["global_step"] for r in results] == [5, 5]
    assert all(r["should_stop"] and r["exception"] is None and r["params_finite"] for r in results)
    events = read_events(Path(results[0]["log_dir"]) / "debug_outputs")
    loss_events = [e for e in events if e["kind"] == "nonfinite_loss" and e.get("episode") == "start"]
    assert len(loss_events) == 1, "written once, by rank zero"
    assert loss_events[0]["step"] == 4 and loss_events[0]["details"]["ranks"] == [1]
    assert "on rank 1" in loss_events[0]["message"]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_raise_on_rank_one_raises_on_both_ranks(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "raise")
    assert [(r["exception"], r["exception_step"]) for r in results] == [("AnomalyError", 4)] * 2


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_skip_on_rank_zero_skips_on_both_ranks(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "skip", nan_rank=0, nan_step=6)
    assert [r["global_step"] for r in results] == [12, 12]
    assert all(r["params_finite"] and r["exception"] is None for r in results)
