"""``symmetric_units``: a layer whose units are copies, weights and gradient alike (a constant init), beside the
layers whose weights alone are alike (zero-initialized on purpose) or whose gradient rows alone are (a mean over the
units), which their first step or their random weights keep apart."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_debug.core.kinds import Kind
from lightning_debug.core.verdicts import VerdictEngine
from lightning_debug.monitors.gradients.symmetry import UnitSpread, copies, judge_symmetry, judged, unit_spread


def mlp(init: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        if init == "constant":
            nn.init.constant_(layer.weight, 0.1)
            nn.init.zeros_(layer.bias)
        elif init == "zeros":
            nn.init.zeros_(layer.weight)
    if init == "zero_head":
        nn.init.zeros_(model[4].weight)
    return model


def read(model: nn.Module, loss_of=lambda out, y: F.cross_entropy(out, y)) -> dict[str, tuple[float, ...]]:
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    model.zero_grad()
    loss_of(model(x), y).backward()
    names, params = zip(*model.named_parameters())
    measured = UnitSpread().measure(0, names, params)
    assert measured is not None
    return UnitSpread.spreads(measured[0].values(), measured[1])


def flagged(spreads: dict[str, tuple[float, ...]]) -> list[str]:
    """What two readings of ``spreads`` name (the kind's policy: 2 in a row)."""
    engine = VerdictEngine()
    judge_symmetry(0, spreads, engine)
    verdict = judge_symmetry(100, spreads, engine)
    return [] if verdict is None else verdict.finding.details["parameters"]


def test_a_constant_init_makes_every_hidden_unit_a_copy_and_names_those_layers() -> None:
    """Both hidden layers start as copies; the second's units meet the random head, whose columns give each a gradient
    of its own, so only the first stays copies (and is named)."""
    spreads = read(mlp("constant"))
    assert flagged(spreads) == ["0.weight"]
    assert spreads["2.weight"][1] == 0.0 and spreads["2.weight"][3] > 1e-3 * spreads["2.weight"][4]
    engine = VerdictEngine()
    assert judge_symmetry(0, spreads, engine) is None  # held
    verdict = judge_symmetry(100, spreads, engine)
    assert verdict is not None and verdict.finding.kind is Kind.SYMMETRIC_UNITS and verdict.steps == [0, 100]
    assert verdict.finding.details["units"] == [16] and "constant" in verdict.finding.message
    assert set(spreads) == {"0.weight", "2.weight", "4.weight"}  # biases have no units to compare


def test_random_weights_and_zero_initialized_layers_are_not_copies() -> None:
    """The twins: PyTorch's default init; a hidden layer zero-initialized (every unit's weights 0, as LoRA's ``B``)
    between random ones, and a zero-initialized head: their units' gradients differ, so the first step parts them."""
    assert flagged(read(mlp("default"))) == []
    assert flagged(read(mlp("zeros"))) == []
    assert flagged(read(mlp("zero_head"))) == []


def test_random_weights_whose_gradient_rows_agree_are_not_copies() -> None:
    """A loss of the mean over a linear layer's units gives every unit the same gradient row; its random weights
    keep the units apart."""
    layer = nn.Linear(8, 16)
    spreads = read(nn.Sequential(layer), lambda out, y: out.mean())
    units, weight_spread, weight_size, grad_spread, grad_size = spreads["0.weight"]
    assert grad_spread <= 1e-6 * grad_size and weight_spread > 0.1 * weight_size
    assert flagged(spreads) == []


def test_a_reading_that_finds_no_copies_ends_the_hold() -> None:
    engine = VerdictEngine()
    copied = {"a.weight": (8.0, 0.0, 0.1, 0.0, 0.02)}
    judge_symmetry(0, copied, engine)
    assert judge_symmetry(100, {"a.weight": (8.0, 0.05, 0.1, 0.0, 0.02)}, engine) is None
    assert judge_symmetry(200, copied, engine) is None  # a new hold


def test_copies_need_a_gradient() -> None:
    """All-zero weights without a gradient (a layer nothing reaches) are another kind's: not copies here."""
    assert copies(0.0, 0.1, 0.0, 0.02) and not copies(0.0, 0.0, 0.0, 0.0) and not copies(1e-3, 0.1, 0.0, 0.02)


def test_what_is_read_and_what_is_not() -> None:
    conv = nn.Conv2d(3, 8, 3)
    nn.init.constant_(conv.weight, 0.5)
    conv(torch.randn(2, 3, 8, 8)).square().sum().backward()
    assert judged(conv.weight) and not judged(conv.bias)
    weight_spread, weight_size, grad_spread, grad_size = unit_spread(conv.weight).tolist()
    assert weight_spread == 0.0 and weight_size == 0.5 and grad_size > 0
    single = nn.Parameter(torch.ones(1, 4))
    single.grad = torch.ones(1, 4)
    frozen = nn.Parameter(torch.ones(4, 4), requires_grad=False)
    assert not judged(single) and not judged(frozen)


def test_readings_are_at_least_a_hundred_steps_apart() -> None:
    model = mlp("constant")
    read(model)
    names, params = zip(*model.named_parameters())
    spread = UnitSpread()
    assert spread.measure(0, names, params) is not None
    assert spread.measure(50, names, params) is None and spread.step == 0
    assert spread.measure(100, names, params) is not None and spread.step == 100
