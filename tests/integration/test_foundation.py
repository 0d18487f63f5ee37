"""The shared pieces on their own: tensor inspection, events file, report, command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_debug import TensorStats, __version__, inspect_tensor
from lightning_debug.checks.numerics import NormPlan, fused_norms
from lightning_debug.core.events import EventLog
from lightning_debug.core.guard import Failures
from lightning_debug.core.readback import Readback
from lightning_debug.report.offline import read_events_file


def test_inspect_tensor_reports_nonfinite_values_and_finite_statistics() -> None:
    stats = inspect_tensor(torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]], requires_grad=True) * 1)
    assert isinstance(stats, TensorStats)
    assert stats.shape == (2, 2) and stats.dtype == "float32" and stats.device == "cpu" and stats.bytes == 16
    assert stats.has_nan and stats.has_inf and stats.nonfinite_count == 2 and not stats.is_finite
    assert (stats.min, stats.max, stats.mean, stats.std) == (1.0, 3.0, 2.0, 1.0)
    assert stats.grad_fn == "MulBackward0"
    assert "2 non-finite" in str(stats)


@pytest.mark.parametrize("tensor", [torch.empty(0), torch.arange(6).reshape(2, 3), torch.ones(3, dtype=torch.bool),
                                    torch.tensor([3 + 4j]), torch.eye(3).to_sparse(),
                                    torch.full((2,), float("nan"))])
def test_inspect_tensor_handles_odd_tensors(tensor: torch.Tensor) -> None:
    stats = inspect_tensor(tensor)
    assert stats.numel == tensor.numel()
    if tensor.is_complex():
        assert stats.max == 5.0
    if not tensor.is_sparse and torch.is_floating_point(tensor) and tensor.numel() and torch.isnan(tensor).all():
        assert stats.mean is None and stats.nonfinite_count == 2


def test_fused_norms_match_per_tensor_norms_for_mixed_tensors() -> None:
    tensors = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64), torch.randn(4).to(torch.bfloat16),
               torch.eye(2).to_sparse(), torch.tensor([3 + 4j]), torch.empty(0)]
    expected = [torch.linalg.vector_norm(t.to_dense().abs().double()).item() for t in tensors]
    assert fused_norms(tensors).tolist() == pytest.approx(expected, rel=1e-2)
    assert Readback(fused_norms(tensors), blocking=False).values() == pytest.approx(expected, rel=1e-2)


def test_norm_plan_measures_every_kind_of_slot_in_slot_order_and_survives_a_sparse_gradient() -> None:
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randn(5, 3, generator=generator), torch.randn(7, dtype=torch.float64, generator=generator),
                torch.randn(4, generator=generator).to(torch.bfloat16), torch.randn((), generator=generator),
                torch.randn(3, 5, generator=generator).t(), torch.randn(6000, generator=generator),
                torch.tensor([3 + 4j]), torch.empty(0), torch.randn(2, 3, generator=generator)]
    plan = NormPlan(examples)
    expected = [torch.linalg.vector_norm(t.abs().double()).item() ** 2 for t in examples]
    assert plan.squares(examples).tolist() == pytest.approx(expected, rel=1e-5)
    examples[1][2] = float("nan")
    assert [math.isfinite(v) for v in plan.squares(examples).tolist()] == [i != 1 for i in range(len(examples))]
    with_sparse = [torch.eye(5, 3).to_sparse(), *examples[1:]]
    assert plan.squares(with_sparse).tolist()[0] == pytest.approx(3.0) and not plan.fused


def test_norm_plan_joins_many_small_tensors_without_mixing_them_up() -> None:
    """Enough small tensors for the joined paths: same-shape rows (1-d, transposed 2-d, 0-d, one of
    them bfloat16), segments of odd shapes, a mid-size loner, empty and complex slots, shuffled."""
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randn(16, generator=generator) for _ in range(20)]
    examples += [torch.randn(16, generator=generator).to(torch.bfloat16)]
    examples += [torch.randn(3, 5, generator=generator).t() for _ in range(9)]
    examples += [torch.randn((), generator=generator) for _ in range(8)]
    examples += [torch.randn(7, dtype=torch.float64, generator=generator), torch.randn(2, 3, generator=generator)]
    examples += [torch.randn(4, generator=generator).to(torch.bfloat16) for _ in range(3)]
    examples += [torch.randn(k, 3, generator=generator) for k in range(1, 13)]
    examples += [torch.randn(2000, generator=generator), torch.randn(6000, generator=generator)]
    examples += [torch.empty(0) for _ in range(8)] + [torch.tensor([3 + 4j])]
    order = torch.randperm(len(examples), generator=generator).tolist()
    examples = [examples[i] for i in order]
    plan = NormPlan(examples)
    assert plan._rows and plan._segments  # the joined paths are what this test is about
    expected = [torch.linalg.vector_norm(t.abs().double()).item() ** 2 for t in examples]
    assert plan.squares(examples).tolist() == pytest.approx(expected, rel=1e-3, abs=1e-6)
    for broken in (i for i, t in enumerate(examples) if t.numel() and not t.is_complex()):
        poisoned = [t.clone() for t in examples]
        poisoned[broken][(0,) * poisoned[broken].dim()] = float("nan")
        finite = [math.isfinite(v) for v in plan.squares(poisoned).tolist()]
        assert finite == [i != broken for i in range(len(examples))]
    snapshot = plan.snapshot(examples)
    moved = [t if t.is_complex() else t + 1 for t in examples]
    assert plan.distance_squares(snapshot, moved).tolist() == pytest.approx(
        [0.0 if t.is_complex() else float(t.numel()) for t in examples], rel=1e-2)


def test_norm_plan_gives_a_few_odd_small_tensors_to_the_fused_norm() -> None:
    """Three odd shapes beside 40 same-shape rows (an MoE router beside its layers): a segmented sum costs
    more than three more slots in the fused norm, and the values are the same either way."""
    generator = torch.Generator().manual_seed(1)
    examples = [torch.randn(32, generator=generator) for _ in range(40)]
    examples += [torch.randn(8, 4, generator=generator), torch.randn(4, 8, generator=generator), torch.randn(5)]
    plan = NormPlan(examples)
    assert plan._rows and not plan._segments
    expected = [torch.linalg.vector_norm(t.double()).item() ** 2 for t in examples]
    assert plan.squares(examples).tolist() == pytest.approx(expected, rel=1e-5)


def test_events_are_flushed_per_line_and_a_truncated_last_line_is_tolerated(tmp_path: Path) -> None:
    log = EventLog(tmp_path, Failures())
    log.write({"step": 1, "kind": "nonfinite_loss", "severity": "error", "details": {"norm": float("inf")}})
    log.write({"step": 2, "kind": "slow_step", "severity": "warning", "details": {}})
    path = tmp_path / "events.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["details"]["norm"] == "inf" and "time" in json.loads(lines[0])
    with open(path, "a") as handle:
        handle.write('{"step": 3, "kind": "oo')
    events = read_events_file(path)
    assert [e["step"] for e in events.records] == [1, 2] and events.truncated_last_line


def test_command_line_version_and_help() -> None:
    version = subprocess.run([sys.executable, "-m", "lightning_debug", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"lightning-debug {__version__}"
    help_text = subprocess.run([sys.executable, "-m", "lightning_debug", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "demo" in help_text.stdout
