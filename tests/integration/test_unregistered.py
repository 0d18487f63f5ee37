"""``frozen_param`` (``unregistered``) in real runs: tensors the backward reaches that the model does not register.

Hidden layers kept in a Python list and a scale made with ``requires_grad=True`` instead of ``nn.Parameter`` are used
by every forward and never trained; each is named by where the module keeps it, in a Lightning fit and in an
Accelerate loop. The closest healthy runs stay quiet: the same layers in an ``nn.ModuleList``, a gradient penalty
over inputs made anew each step with ``requires_grad=True`` (WGAN-GP), and a perturbation kept across steps that the
training step updates by hand (free adversarial training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig
from lightning_debug.monitors.gradients.unregistered import SPACING
from tests.harness.toolkit import TinyRegressor, accelerate_regression, all_four, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(180)


class Hidden(TinyRegressor):
    """Two more hidden layers before ``head``: in a Python list (``registered`` False) or a ModuleList."""

    def __init__(self, registered: bool = True) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        layers = [nn.Linear(16, 16), nn.Linear(16, 16)]
        self.blocks = nn.ModuleList(layers) if registered else layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(torch.relu(self.inp(x))))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


class Scaled(TinyRegressor):
    """A learnt output scale: ``torch.ones(1, requires_grad=True)`` (``registered`` False) or an ``nn.Parameter``."""

    def __init__(self, registered: bool = True) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.scale = nn.Parameter(torch.ones(1)) if registered else torch.ones(1, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class GradientPenalty(TinyRegressor):
    """The loss plus WGAN-GP's penalty on the input gradient at points made anew each step with requires_grad."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        points = (x + 0.1 * torch.randn_like(x)).requires_grad_(True)
        gradient, = torch.autograd.grad(self(points).sum(), points, create_graph=True)
        return nn.functional.mse_loss(self(x), y) + 0.1 * (gradient.norm(dim=1) - 1).pow(2).mean()


class FreeAdversarial(TinyRegressor):
    """A perturbation kept across steps with requires_grad, stepped by hand up its gradient's sign after each
    backward (free adversarial training); the optimizer holds the model's parameters only."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.delta = torch.zeros(16, 8, requires_grad=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x + self.delta[:len(x)]), y)

    def on_after_backward(self) -> None:
        with torch.no_grad():
            self.delta.add_(0.01 * self.delta.grad.sign()).clamp_(-0.1, 0.1)
            self.delta.grad.zero_()


def fit(root: Path, model: TinyRegressor, steps: int = 2 * SPACING + 1) -> list[dict[str, Any]]:
    trainer = fit_seeded(root, model, all_four(DebugConfig(save_plots=False)), max_steps=steps)
    return read_events(debug_dir(trainer))


def serious(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("severity") in ("warning", "error", "critical") and e.get("episode") != "end"]


@pytest.mark.parametrize(("model", "named"), [
    (lambda: Hidden(registered=False), ["blocks[0].weight", "blocks[0].bias", "blocks[1].weight", "blocks[1].bias"]),
    (lambda: Scaled(registered=False), ["scale"]),
], ids=["layers in a list", "tensor not a parameter"])
def test_tensors_the_model_does_not_register_are_named_where_it_keeps_them(tmp_path: Path, model: Any,
                                                                         named: list[str]) -> None:
    found = serious(fit(tmp_path, model()))
    assert [(e["kind"], e["step"], e["details"]["cause"]) for e in found] == [("frozen_param", SPACING, "unregistered")]
    assert found[0]["details"]["parameters"] == named and found[0]["details"]["since_step"] == 0
    assert "nn.ModuleList" in found[0]["message"] and "nn.Parameter" in found[0]["message"]


@pytest.mark.parametrize("model", [lambda: Hidden(registered=True), lambda: Scaled(registered=True),
                                   GradientPenalty, FreeAdversarial],
                         ids=["ModuleList", "nn.Parameter", "gradient penalty on new inputs", "perturbation updated"])
def test_registered_made_anew_or_updated_by_hand_is_quiet(tmp_path: Path, model: Any) -> None:
    assert serious(fit(tmp_path, model())) == []


def test_layers_in_a_list_are_named_in_an_accelerate_loop(tmp_path: Path) -> None:
    def step(accelerator: Any, model: nn.Module, optimizer: Any) -> None:
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    found = serious(accelerate_regression(tmp_path, Hidden(registered=False),
                                          lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), step, epochs=13))
    assert [(e["kind"], e["details"]["cause"], e["details"]["parameters"][0]) for e in found] == [
        ("frozen_param", "unregistered", "blocks[0].weight")]
