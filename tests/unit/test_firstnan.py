"""Which kernel a replayed forward blames (checks/firstnan.py through localize): in place, -inf and NaN."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_debug.checks.localize import Cause, localize


class Step(nn.Module):
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def cause_of(body: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Cause:
    model = Step(body)
    return localize(model, x, lambda: model(x).sum(), None, check_backward=False)


def absorbed(x: torch.Tensor) -> torch.Tensor:
    weights = torch.exp(torch.log(x * 0.0))  # log(0) = -inf, which exp turns back into 0
    return weights / weights.sum()  # 0 / 0


def overflow(x: torch.Tensor) -> torch.Tensor:
    big = torch.exp(x * 1e3)
    return big - big


def in_place_relu(x: torch.Tensor) -> torch.Tensor:
    y = x - 1.0
    torch.relu_(y)
    return torch.log(y)  # log(0) = -inf: the loss is -inf, not NaN


def test_an_infinity_a_later_kernel_absorbs_is_no_cause() -> None:
    cause = cause_of(absorbed, torch.ones(4))
    assert cause.operation == "Tensor.div" and "weights / weights.sum()" in cause.source["code"]
    assert "from finite inputs" in cause.summary and "torch.log" not in cause.summary


def test_an_overflow_that_becomes_nan_later_blames_the_overflow() -> None:
    cause = cause_of(overflow, torch.ones(4))
    assert cause.operation == "torch.exp"
    assert cause.summary.endswith("`Tensor.sub` at test_firstnan.py:34 (`return big - big`) then turned the Inf into NaN")


def test_an_in_place_kernel_is_judged_by_its_inputs_before_it_ran() -> None:
    cause = cause_of(lambda x: x.masked_fill_(x > 0, 0.0).div_(x.sum()), torch.ones(3))
    assert cause.kernel == "aten::div_" and "(in place)" in cause.summary


def test_an_inf_loss_names_the_first_kernel_that_made_it() -> None:
    cause = cause_of(in_place_relu, torch.ones(3))
    assert cause.operation == "torch.log" and "from finite inputs" in cause.summary


def test_a_deliberate_infinity_that_a_kernel_cannot_absorb() -> None:
    cause = cause_of(lambda x: x.masked_fill(x > 0, float("inf")) * 0.0, torch.ones(3))
    assert cause.kernel == "aten::mul" and "held Inf but no NaN" in cause.summary


def masked_then_log(x: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(x.masked_fill(x > 0, float("-inf")), dim=0)  # every element masked: NaN
    return weights.sum() + torch.log(x * 0.0).sum()  # a later -inf is no part of the story


def test_a_fully_masked_softmax_is_named_before_a_later_infinity() -> None:
    cause = cause_of(masked_then_log, torch.ones(3))
    assert cause.operation == "torch.softmax" and cause.inputs["fully_masked_rows"] == 1
    assert cause.summary.endswith("(a fully masked row; 1 of 1 rows)")
