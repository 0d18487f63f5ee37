"""``symmetric_units`` through a real Trainer at the defaults: hidden layers initialized to one constant (their units
copies for the whole run, "No problems found" before) are named at step 0 with the layers whose units stay copies,
beside PyTorch's default init and a hidden layer zero-initialized on purpose, whose units the gradient parts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import debug_dir, fit_seeded, read_events
from tests.integration.test_activation_defaults import Net, warnings_of


class Initialized(Net):
    """The MLP of the activation tests with its hidden layers initialized by ``init``: ``constant`` (every layer and
    the head 0.1, biases 0), ``zero_hidden`` (the second hidden layer's weights 0, the rest PyTorch's default)."""

    def __init__(self, init: str) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        with torch.no_grad():
            if init == "constant":
                for layer in [*self.layers, self.head]:
                    nn.init.constant_(layer.weight, 0.1)
                    nn.init.zeros_(layer.bias)
            elif init == "zero_hidden":
                nn.init.zeros_(self.layers[1].weight)


def fit(tmp_path: Path, init: str, steps: int = 201) -> list[dict]:
    config = DebugConfig(print_summary=False, save_plots=False)
    trainer = fit_seeded(tmp_path, Initialized(init), [GradientHealthCallback(config)], max_steps=steps)
    return read_events(debug_dir(trainer))


def test_hidden_layers_initialized_to_a_constant_are_symmetric_units_from_step_0(tmp_path: Path) -> None:
    events = fit(tmp_path, "constant")
    named = [e for e in events if e["kind"] == "symmetric_units" and e["severity"] == "warning"]
    assert named and named[0]["step"] == 0, warnings_of(events)
    assert named[0]["details"]["parameters"] == ["layers.0.weight", "layers.1.weight", "layers.2.weight"]
    assert named[0]["details"]["units"] == [32, 32, 32]
    assert "nn.init.constant_" in named[0]["message"] and "read at step 100" in named[0]["message"]


@pytest.mark.parametrize("init", ["default", "zero_hidden"])
def test_random_and_zero_initialized_hidden_layers_are_quiet(tmp_path: Path, init: str) -> None:
    assert warnings_of(fit(tmp_path, init)) == []
