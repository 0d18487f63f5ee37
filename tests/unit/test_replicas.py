"""``replicas_diverged`` (issue 45): the rule fed recorded per-rank norms, and where the shared pass puts them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_debug.core.numerics import ParameterIndex, StepNumerics
from lightning_debug.core.numerics import step as step_module
from lightning_debug.monitors.gradients.replicas import RELATIVE_TOLERANCE, judge_replicas

NAMES = ["a.weight", "a.bias", "b.weight"]


def squares(*norms: list[float]) -> torch.Tensor:
    return torch.tensor(norms, dtype=torch.float64).square()


def test_identical_replicas_and_reduction_noise_are_quiet() -> None:
    assert judge_replicas(100, NAMES, squares([2.0, 1.0, 3.0], [2.0, 1.0, 3.0])) is None
    noise = 1 + RELATIVE_TOLERANCE / 10  # another summation order of the norm kernel, a few float32 ulps
    assert judge_replicas(100, NAMES, squares([2.0, 1.0, 3.0], [2.0 * noise, 1.0, 3.0 / noise])) is None


def test_a_step_taken_apart_is_named_with_its_parameters_and_the_rank() -> None:
    verdict = judge_replicas(100, NAMES, squares([2.0, 1.0, 3.0], [2.0, 1.001, 3.5]))
    assert verdict is not None
    details = verdict.finding.details
    assert verdict.finding.severity.value == "error"
    assert details["parameters"] == ["a.bias", "b.weight"] and details["ranks"] == [1]
    assert details["agreeing_ranks"] == [0] and details["judged"] == 3
    assert details["relative_difference"]["a.bias"] == pytest.approx(0.001 / 1.001)
    assert "rank 1 holds other values than rank 0" in verdict.finding.message and "`a.bias`" in verdict.finding.message


@pytest.mark.parametrize(("odd", "agreeing"), [(2, [0, 1, 3]), (0, [1, 2, 3])])
def test_the_ranks_outside_the_largest_agreeing_group_are_named(odd: int, agreeing: list[int]) -> None:
    rows = [[2.0, 1.0, 3.0] for _ in range(4)]
    rows[odd] = [2.5, 1.0, 3.0]
    verdict = judge_replicas(7, NAMES, squares(*rows))
    assert verdict is not None
    assert verdict.finding.details["ranks"] == [odd] and verdict.finding.details["agreeing_ranks"] == agreeing


def test_non_finite_weights_and_a_single_rank_are_left_alone() -> None:
    assert judge_replicas(3, NAMES, squares([2.0, math.nan, 3.0], [2.0, 1.0, 3.0])) is None  # the non-finite kinds
    assert judge_replicas(3, NAMES, squares([2.0, 1.0, 3.0])) is None
    assert judge_replicas(3, [], torch.zeros((2, 0), dtype=torch.float64)) is None


def test_one_process_compares_nothing() -> None:
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    index = ParameterIndex(list(model.named_parameters()))
    host = StepNumerics(0, index, with_replicas=True).read()
    assert index.replicas == [] and host.replica_names == [] and tuple(host.replica_squares().shape) == (1, 0)
    assert not host.params_measured


def test_every_ranks_norms_come_after_the_shared_values_in_the_one_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of two: its own norms in its block, the other rank's arrive by the sum; the weight norms logged
    (``with_param_norms``) and the gradient norms are read where they were, without the replica block."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    index = ParameterIndex(list(model.named_parameters()), rank=1)
    index.replicas = [0, 2]
    monkeypatch.setattr(step_module, "distributed", lambda: (1, 2))
    other = torch.tensor([5.0, 7.0], dtype=torch.float64)
    reductions: list[int] = []

    def all_reduce(packed: torch.Tensor) -> None:  # rank 0's contribution: its block of replica norms
        reductions.append(packed.numel())
        packed[-4:-2] += other

    host = StepNumerics(0, index, None, all_reduce, with_param_norms=True, with_replicas=True).read()
    own = torch.stack([p.detach().double().norm() for p in model.parameters()]).square()
    assert len(reductions) == 1
    assert host.replica_names == ["0.weight", "1.weight"]
    rows = host.replica_squares()
    assert rows[0].tolist() == other.tolist()
    assert rows[1].tolist() == pytest.approx(own[[0, 2]].tolist())
    # rank 1 owns no plain tensor's share of the sums (rank 0 adds them): zeros, and no replica norm among them
    assert host.params_measured and host.param_norms == [0.0] * 4 and host.grad_norms == [0.0] * 4
