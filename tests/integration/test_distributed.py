"""Two CPU processes (gloo): every rank takes the same decision at the same step, files come from rank zero."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_debug.report.summary import plot_worth_drawing
from tests.harness.toolkit import read_events, read_report

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ddp_worker.py"
TIMEOUT_S = 150


def run_two_ranks(tmp_path: Path, mode: str, nan_rank: int = 1, nan_step: int = 4, strategy: str = "ddp",
                  all_four: bool = False, level: str = "basic", *faults: str,
                  timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(WORKER), mode, str(tmp_path), str(nan_rank), str(nan_step), strategy,
               "--level", level, *faults]
    command += ["--all-four"] if all_four else []
    # its own session, so that a hang ends with every rank killed (Lightning turns SIGTERM into a graceful stop
    # that a rank stuck in a collective never reaches, and the launcher's child would outlive it)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=tmp_path, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        stderr = f"{stderr}\nHANG: killed after {timeout_s} s"
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert len(results) == 2, f"both ranks must finish; stderr:\n{stderr[-3000:]}"
    for result in results:
        result["stderr_tail"] = stderr[-3000:]
    return results


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_stop_on_rank_one_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    """Under Lightning's own launcher (rank 0 runs the script again for rank 1); the other tests fork the ranks."""
    results = run_two_ranks(tmp_path, "stop", 1, 4, "ddp", False, "basic", "--lightning-launcher")
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


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_skip_restores_batchnorm_statistics_on_every_rank(tmp_path: Path) -> None:
    """A NaN sample on rank 0 at step 5 poisons rank 0's running statistics (which DDP broadcasts to the
    other ranks at every forward); both ranks skip the step and restore their own, so every buffer stays
    finite and training goes on."""
    results = run_two_ranks(tmp_path, "skip", 0, 5, "ddp", False, "basic", "--nan-sample-batchnorm")
    assert [r["global_step"] for r in results] == [12, 12]
    assert all(r["exception"] is None and r["params_finite"] and r["buffers_finite"] for r in results)
    assert [r["skipped_steps"] for r in results] == [1, 1]
    assert [r["batches_tracked"] for r in results] == [11, 11], "the skipped forward is undone on both ranks"
    assert results[0]["decisions"][5] == [5, "skip"] and results[1]["decisions"][5] == [5, "skip"]
    assert results[0]["gather_steps"] == results[1]["gather_steps"]


# --- all four callbacks, every check on every step ---------------------------------------------------
def files_named(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


def assert_same_on_both_ranks(results: list[dict[str, Any]]) -> None:
    """The decisions, the steps at which each rank entered the plugin's collectives, and the weights."""
    zero, one = results
    assert zero["decisions"] == one["decisions"]
    assert zero["gather_steps"] == one["gather_steps"] and zero["gather_steps"], "collectives on every rank alike"
    assert (zero["exception"], zero.get("exception_step")) == (one["exception"], one.get("exception_step"))
    assert zero["global_step"] == one["global_step"]
    assert zero["param_checksum"] == pytest.approx(one["param_checksum"], rel=1e-9), "replicas stay identical"


def assert_written_once_by_rank_zero(tmp_path: Path, results: list[dict[str, Any]]) -> Path:
    """One events.jsonl and one report.json in the whole run tree, in rank zero's debug directory."""
    zero, one = results
    assert zero["is_global_zero"] and not one["is_global_zero"]
    assert one["output_dir"] is None and one["events_path"] is None, "rank 1 writes no files"
    debug_dir = Path(zero["output_dir"])
    assert files_named(tmp_path, "events.jsonl") == [debug_dir / "events.jsonl"]
    assert files_named(tmp_path, "report.json") == [debug_dir / "report.json"]
    assert len(files_named(tmp_path, "events.out.tfevents*")) == 1, "scalars from rank zero only"
    if importlib.util.find_spec("matplotlib") is not None:  # drawn only when worth it (a finding or a long run)
        drawn = files_named(tmp_path, "debug_analysis.png")
        if not plot_worth_drawing(read_report(debug_dir)):
            assert drawn == []
        elif drawn != [debug_dir / "debug_analysis.png"]:
            # A plot that could not be drawn is a recorded failure of rank zero, never a silent one.
            assert drawn == [] and "drawing debug_analysis.png" in zero["failed_checks"], (
                drawn, zero["failed_checks"], zero["stderr_tail"])
    return debug_dir


def assert_anomaly_labelled_with_rank(debug_dir: Path, step: int, rank: int) -> None:
    starts = [e for e in read_events(debug_dir) if e["kind"] == "nonfinite_loss" and e.get("episode") == "start"]
    assert len(starts) == 1
    assert starts[0]["step"] == step and starts[0]["details"]["ranks"] == [rank]
    assert starts[0]["details"]["world_size"] == 2 and f"on rank {rank}" in starts[0]["message"]
    finding = read_report(debug_dir)["findings"]["nonfinite_loss"]
    assert finding["first_step"] == step and f"on rank {rank}" in finding["first_message"]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_all_four_stop_on_rank_one(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "stop", nan_rank=1, nan_step=4, all_four=True)
    assert_same_on_both_ranks(results)
    assert results[0]["decisions"] == [[step, "step"] for step in range(4)] + [[4, "skip+stop"]]
    assert all(r["global_step"] == 5 and r["should_stop"] and r["params_finite"] and r["exception"] is None
               for r in results)
    debug_dir = assert_written_once_by_rank_zero(tmp_path, results)
    assert_anomaly_labelled_with_rank(debug_dir, step=4, rank=1)
    report = read_report(debug_dir)
    assert report["status"] == "finished" and report["last_step"] == 5
    assert {"anomaly", "gradients", "memory", "performance"} <= set(report["sections"])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_all_four_raise_on_rank_zero_with_the_cause_replayed_on_every_rank(tmp_path: Path) -> None:
    # level ADVANCED replays the first anomalous step to name the cause, and gathers the causes
    # (all_gather_object): a collective that every rank must enter, or the run hangs
    results = run_two_ranks(tmp_path, "raise", nan_rank=0, nan_step=4, all_four=True, level="advanced")
    assert_same_on_both_ranks(results)
    assert [(r["exception"], r["exception_step"]) for r in results] == [("AnomalyError", 4)] * 2
    assert all("at step 4 on rank 0. Cause: on rank 0: `torch.log`" in r["exception_message"] for r in results), \
        "both ranks raise naming rank 0 and the cause its replay found"
    assert results[0]["decisions"] == [[step, "step"] for step in range(4)]
    debug_dir = Path(results[0]["output_dir"])
    assert results[1]["output_dir"] is None
    assert files_named(tmp_path, "events.jsonl") == [debug_dir / "events.jsonl"]
    assert files_named(tmp_path, "report.json") == [debug_dir / "report.json"]
    assert_anomaly_labelled_with_rank(debug_dir, step=4, rank=0)
    cause = next(e for e in read_events(debug_dir) if e["kind"] == "nonfinite_loss")["details"]["cause"]
    assert sorted(cause["outputs"]["per_rank"]) == ["0", "1"], "each rank's replay result, labelled by rank"
    report = read_report(debug_dir)
    assert report["status"] == "failed" and "AnomalyError" in report["error"]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_all_four_skip_on_rank_one(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "skip", nan_rank=1, nan_step=6, all_four=True)
    assert_same_on_both_ranks(results)
    assert results[0]["decisions"] == [[s, "step"] for s in range(6)] + [[s, "skip"] for s in range(6, 12)]
    assert all(r["global_step"] == 12 and r["skipped_steps"] == 6 and r["params_finite"] for r in results)
    debug_dir = assert_written_once_by_rank_zero(tmp_path, results)
    assert_anomaly_labelled_with_rank(debug_dir, step=6, rank=1)
    ends = [e for e in read_events(debug_dir) if e["kind"] == "nonfinite_loss" and e.get("episode") == "end"]
    assert [(e["details"]["first_step"], e["details"]["steps"]) for e in ends] == [(6, 6)]
    assert read_report(debug_dir)["sections"]["anomaly"]["skipped_steps"] == 6


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_all_four_pickle_and_run_under_ddp_spawn(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, "skip", nan_rank=1, nan_step=6, strategy="ddp_spawn", all_four=True)
    assert_same_on_both_ranks(results)
    assert all(r["global_step"] == 12 and r["skipped_steps"] == 6 for r in results)
    debug_dir = assert_written_once_by_rank_zero(tmp_path, results)
    report = read_report(debug_dir)
    assert report["status"] == "finished"
    # the batch-mixing probe ran on every rank's first batch (a DistributedSampler that shuffles), with no collective
    assert report["sections"]["activations"]["batch_mixing"] == "each sample's output depends on its input alone"
    assert_anomaly_labelled_with_rank(debug_dir, step=6, rank=1)
    written = max(path.stat().st_mtime for path in debug_dir.iterdir() if path.is_file())
    assert results[1]["finished_at"] >= written, "rank 1 leaves the run only once rank zero has written its files"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_ddp_unused_parameters_error_names_the_parameters(tmp_path: Path) -> None:
    """DDP's own message gives only indices ("Parameter indices which did not receive grad for rank 0: 6 7")."""
    results = run_two_ranks(tmp_path, "warn", -1, 4, "ddp", False, "basic", "--unused-layer")
    assert [(r["exception"], r["global_step"]) for r in results] == [("RuntimeError", 1)] * 2
    assert all("not used in producing the loss" in r["exception_message"] for r in results), "Lightning's own error"
    debug_dir = Path(results[0]["output_dir"])
    events = [e for e in read_events(debug_dir) if e["kind"] == "exception"]
    assert len(events) == 1 and events[0]["step"] == 1, "written once, by rank zero"
    details = events[0]["details"]
    assert details["category"] == "ddp_unused_parameters"
    assert details["parameters"] == ["unused.weight", "unused.bias"] and details["indices"] == [6, 7]
    assert "`unused.weight`, `unused.bias`" in events[0]["message"]
    assert "find_unused_parameters" in (debug_dir / "report.md").read_text()
    assert files_named(tmp_path, "exception_step1_rank1.md"), "rank 1 explains its own error in its own file"


# --- issue 17: no rank decides alone -------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("mode", ["skip", "stop", "raise"])
def test_writes_failing_on_rank_zero_only_change_no_decision(tmp_path: Path, mode: str) -> None:
    """Every write of rank 0 fails (events, scalars, TensorBoard text, and our warnings raise as errors there);
    both ranks still take the same decision at the same step, keep identical weights, and nobody hangs.
    In ``skip`` mode rank 1's own measurement also raises at step 2: a flag in the gathered row, on which
    every rank continues that step without a decision."""
    faults = ["--fail-writes-rank0"] + (["--fail-check-rank1-step", "2"] if mode == "skip" else [])
    results = run_two_ranks(tmp_path, mode, 1, 4, "ddp", True, "basic", *faults)
    assert_same_on_both_ranks(results)
    if mode == "raise":
        assert [(r["exception"], r["exception_step"]) for r in results] == [("AnomalyError", 4)] * 2
    else:
        expected = {"skip": [[s, "step"] for s in range(4)] + [[s, "skip"] for s in range(4, 12)],
                    "stop": [[s, "step"] for s in range(4)] + [[4, "skip+stop"]]}[mode]
        assert results[0]["decisions"] == expected
        assert all(r["params_finite"] and r["exception"] is None for r in results)
    zero, one = results
    assert {"writing an event", "logging debug scalars"} <= set(zero["failed_checks"]), zero["failed_checks"]
    flagged = {"AnomalyMonitor.before_optimizer_step", "GradientMonitor.before_optimizer_step"} if mode == "skip" \
        else set()
    assert flagged <= set(zero["failed_checks"]) and set(one["failed_checks"]) == flagged, one["failed_checks"]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("sync_grads", [False, True], ids=["detached", "sync_grads"])
def test_advanced_replay_with_a_collective_in_training_step_keeps_the_ranks_together(tmp_path: Path,
                                                                                      sync_grads: bool) -> None:
    """A contrastive-style ``self.all_gather`` inside ``training_step`` (detached, or ``sync_grads=True``) and a
    NaN on rank 1 only, at ADVANCED in warn mode: every rank replays its own forward the same number of times,
    so the gathers match, and none replays the backward (the forward saw the collective). The cause is rank
    1's, never an uninitialized buffer of the gather on rank 0 (issue 25)."""
    flags = ["--gather-in-step"] + (["--sync-grads"] if sync_grads else [])
    results = run_two_ranks(tmp_path, "warn", 1, 4, "ddp", False, "advanced", *flags)
    zero, one = results
    assert zero["exception"] is None and one["exception"] is None
    assert zero["global_step"] == one["global_step"] == 12
    assert zero["gather_steps"] == one["gather_steps"]
    assert zero["gather_steps"].count(4) > 1, "the replay at step 4 ran training_step (and its gather) again"
    events = read_events(Path(zero["output_dir"]))
    loss = next(e for e in events if e["kind"] == "nonfinite_loss" and e.get("episode") == "start")
    assert loss["step"] == 4 and loss["details"]["ranks"] == [1]
    cause = loss["details"]["cause"]
    assert cause["operation"] == "torch.log" and cause["summary"].startswith("on rank 1: `torch.log`"), cause
    assert sorted(cause["outputs"]["per_rank"]) == ["0", "1"]
    activation = [(e["step"], e.get("episode")) for e in events if e["kind"] == "nonfinite_activation"]
    assert activation == [(4, "start"), (11, "end")], "seen once, ended with the run"
