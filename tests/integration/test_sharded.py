"""Sharded training on two CPU processes (gloo): FSDP2 and tensor parallelism through Lightning's
ModelParallelStrategy, with exact norms, the same decision on every rank, and no failed check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.toolkit import read_events, read_report, read_scalars

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
WORKER = Path(__file__).resolve().parents[1] / "workers" / "fsdp_worker.py"
TIMEOUT_S = 180
NAN_STEP = 7


def run_sharded(tmp_path: Path, dp: int, tp: int, mode: str = "skip", nan_rank: int = 1) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(WORKER), str(tmp_path), str(dp), str(tp), mode, str(nan_rank), str(NAN_STEP)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert len(results) == dp * tp, f"every rank must finish; stderr:\n{completed.stderr[-3000:]}"
    return results


def assert_exact_norms(result: dict[str, Any], steps: list[str]) -> None:
    """The plugin's global and per-parameter gradient norms against torch's, on the full parameters."""
    for step in steps:
        reference, measured = result["reference"][step], result["measured"][step]
        assert measured["sharded"]
        assert measured["global_norm"] == pytest.approx(reference["get_total_norm"], rel=1e-6)
        assert measured["global_norm"] == pytest.approx(reference["from_full_tensors"], rel=1e-6)
        assert dict(zip(measured["names"], measured["grad_norms"])) == pytest.approx(reference["per_parameter"],
                                                                                      rel=1e-6)


def assert_same_decisions_and_a_clean_skip(results: list[dict[str, Any]]) -> None:
    expected = [[step, "skip" if step == NAN_STEP else "step"] for step in range(12)]
    for result in results:
        assert result["decisions"] == expected, "the NaN on rank 1 is found at its step, and skipped, on every rank"
        assert result["skip_changed"] == [] and result["skipped_keys"] > 0, \
            "the skipped step left every local shard and every optimizer state tensor bit-identical"
        assert result["params_finite"] and result["global_step"] == 12
        reduced = result["reduce_steps"]  # the step's measurement, then the gate's agreed decision (skip mode)
        assert reduced == sorted(list(range(12)) * 2 + [NAN_STEP]), \
            "two small all-reduces per check step on every rank, and one more on the dropped step (its buffers)"
        assert result["failed_checks"] == {}
        assert not [w for w in result["warnings"] if " failed" in w]
    assert len({r["full_checksum"] for r in results}) == 1


def assert_reported_once(results: list[dict[str, Any]], names: list[str]) -> None:
    debug_dir = Path(results[0]["output_dir"])
    assert all(r["output_dir"] is None for r in results[1:])
    starts = {e["kind"]: e for e in read_events(debug_dir) if e.get("episode") == "start"}
    assert starts["nonfinite_loss"]["step"] == NAN_STEP and starts["nonfinite_loss"]["details"]["ranks"] == [1]
    assert starts["nonfinite_grad"]["step"] == NAN_STEP
    assert not {"exploding_grad", "vanishing_grad", "missing_grad", "frozen_param", "replicas_diverged"} & set(starts)
    report = read_report(debug_dir)
    assert report["failed_checks"] == {} and report["sections"]["anomaly"]["skipped_steps"] == 1
    scalars = read_scalars(results[0]["log_dir"])
    reference = results[0]["reference"]
    for step, value in scalars["debug/grad/global_norm"]:
        if step != NAN_STEP:
            assert value == pytest.approx(reference[str(step)]["get_total_norm"], rel=1e-5)
    for name in names:  # the user's names, no wrapper prefixes
        assert dict(scalars[f"debug/grad/norm/{name}"])[3] == pytest.approx(reference["3"]["per_parameter"][name],
                                                                            rel=1e-5)
        assert f"debug/weight/norm/{name}" in scalars


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_fsdp2_finds_a_nan_on_one_rank_skips_on_every_rank_with_exact_norms(tmp_path: Path) -> None:
    results = run_sharded(tmp_path, dp=2, tp=1)
    assert_same_decisions_and_a_clean_skip(results)
    for result in results:
        assert_exact_norms(result, ["0", "3", "8", "11"])
    assert_reported_once(results, ["model.inp.weight", "model.extra.weight", "model.head.bias"])
    assert all(r["measured"][step]["replicas"] == [] for r in results for step in r["measured"]), \
        "FSDP2's shards are not replicas: none is compared across ranks (replicas_diverged)"
    warned = " ".join(results[0]["warnings"])
    assert "cannot replay a step of a model with sharded" in warned and "histograms are not available" in warned


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_tensor_parallel_on_a_1x2_mesh_with_a_plain_layer(tmp_path: Path) -> None:
    results = run_sharded(tmp_path, dp=1, tp=2)
    assert_same_decisions_and_a_clean_skip(results)
    for result in results:
        assert_exact_norms(result, ["0", "5", "11"])
    assert_reported_once(results, ["model.inp.weight", "model.hidden.bias", "model.head.weight"])
    assert all(r["measured"][step]["replicas"] == ["model.hidden.bias"] for r in results for step in r["measured"]), \
        "only the bias a row-wise layer replicates over the whole mesh is compared across ranks, on every check step"
