"""An optimizer built over a copy of the model (TrainCheck's silent error: ``SGD(copy.deepcopy(layers).parameters())``,
or a model re-created after its optimizer): the trained module's parameters get gradients and never move. Named
``frozen_param`` at the first check step at the defaults; the optimizer over the module itself, and an averaged copy
kept beside it outside the optimizer, stay quiet. Real Trainer runs on CPU."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_debug import GradientHealthCallback, debug_callbacks
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report

pytestmark = pytest.mark.timeout(120)


class OptimizerOver(TinyRegressor):
    """``over="copy"``: SGD over a ``deepcopy`` of the layers (the bug); ``"recreated"``: over layers built again
    after the model (other values, the same shapes); ``"module"``: over the module (the fix), with an averaged copy
    of the layers kept as a submodule that no optimizer holds (healthy)."""

    def __init__(self, over: str) -> None:
        super().__init__(lr=0.05)
        self.over = over
        if over == "module":
            self.averaged = torch.optim.swa_utils.AveragedModel(nn.Sequential(self.inp, self.hidden, self.head))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        layers = nn.ModuleList([self.inp, self.hidden, self.head])
        if self.over == "copy":
            return torch.optim.SGD(copy.deepcopy(layers).parameters(), lr=self.lr)
        if self.over == "recreated":
            return torch.optim.SGD(nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)]).parameters(),
                                   lr=self.lr)
        return torch.optim.SGD(layers.parameters(), lr=self.lr)


def fit(root: Path, model: pl.LightningModule, callbacks: list[Any]) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(root, callbacks, max_steps=12)
        trainer.fit(model)
    return trainer


@pytest.mark.parametrize("over", ["copy", "recreated"])
@pytest.mark.parametrize("all_four", [False, True])
def test_an_optimizer_over_a_copy_of_the_layers_is_frozen_param_at_step_0(tmp_path: Path, over: str,
                                                                          all_four: bool) -> None:
    callbacks = debug_callbacks() if all_four else [GradientHealthCallback()]
    trainer = fit(tmp_path, OptimizerOver(over), callbacks)
    events = read_events(debug_dir(trainer))
    frozen = [e for e in events if e["kind"] == "frozen_param"]
    assert frozen, [e["kind"] for e in events]
    first = frozen[0]
    assert first["step"] == 0 and first["severity"] == "warning" and first["details"]["cause"] == "not_in_optimizer"
    assert first["details"]["parameters"] == ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "head.weight",
                                              "head.bias"]
    assert "copy" in first["message"]
    checks = read_report(debug_dir(trainer))["sections"]["gradients"]["trainability"]["optimizer_check"]
    assert checks.startswith("done") and "copy" in checks


def test_the_optimizer_over_the_module_with_an_averaged_copy_beside_it_is_quiet(tmp_path: Path) -> None:
    trainer = fit(tmp_path, OptimizerOver("module"), [GradientHealthCallback()])
    events = read_events(debug_dir(trainer))
    assert [e for e in events if e["severity"] in ("warning", "error", "critical")] == []
    outside = [e for e in events if e["kind"] == "outside_training"]
    assert outside and outside[0]["details"]["count"] == 6, "the averaged copy: not trained by gradients, on purpose"
