"""A backward ran and no parameter holds a gradient at the optimizer step after it: the loss reaches no parameter
(rebuilt from its value) or the gradients were cleared before the step (manual optimization in the wrong order).
Before, both were judged as steps without a backward (a ``training_step`` that returned None) and the run ended in
``learning_stalled`` blaming the labels. Real Trainer runs, the gradient callback alone at the defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events

pytestmark = pytest.mark.timeout(120)

TRAINABLE = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "head.weight", "head.bias"]


class LossFromNumber(TinyRegressor):
    """``torch.tensor(loss.item(), requires_grad=True)``: what silences "element 0 of tensors does not require grad"
    once the graph was cut."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.tensor(super().training_step(batch, batch_idx).item(), requires_grad=True)


class ManualOrder(TinyRegressor):
    """Manual optimization: ``step()``, ``manual_backward(loss)``, ``zero_grad()`` when ``wrong``, else the order
    of Lightning's documentation."""

    def __init__(self, wrong: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.wrong = wrong

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        if self.wrong:
            optimizer.step()
            self.manual_backward(loss)
            optimizer.zero_grad()
        else:
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss


def fit(tmp_path: Path, model: TinyRegressor, config: DebugConfig, steps: int) -> list[dict[str, Any]]:
    trainer = make_trainer(tmp_path, [GradientHealthCallback(config)], max_steps=steps, limit_val_batches=0)
    trainer.fit(model)
    return [e for e in read_events(debug_dir(trainer)) if e.get("episode") != "end"
            and e["severity"] in ("warning", "error", "critical")]


def first_in_report(tmp_path: Path) -> str:
    """The kind report.md lists first (root causes first)."""
    text = next(tmp_path.rglob("report.md")).read_text()
    return text.split("### 1. `", 1)[1].split("`", 1)[0]


def test_a_loss_rebuilt_from_its_value_is_a_missing_gradient_on_every_parameter_from_step_zero(tmp_path: Path) -> None:
    found = fit(tmp_path, LossFromNumber(), DebugConfig(), 12)
    missing = [e for e in found if e["kind"] == "missing_grad"]
    assert missing and missing[0]["step"] == 0, [(e["kind"], e["step"]) for e in found]
    assert sorted(missing[0]["details"]["parameters"]) == sorted(TRAINABLE)
    assert "graph reaches no parameter" in missing[0]["message"]
    assert "torch.tensor(loss.item(), requires_grad=True)" in missing[0]["message"]
    assert missing[0]["details"]["cause"]["where"] == "loss_without_parameters"
    assert "DDP" not in missing[0]["message"], "no parameter is unused: the loss is"
    assert first_in_report(tmp_path) == "missing_grad"


def test_manual_optimization_stepping_before_the_backward_is_named_with_the_order_to_use(tmp_path: Path) -> None:
    found = fit(tmp_path, ManualOrder(wrong=True), DebugConfig(gradient_checking_frequency=1), 12)
    missing = [e for e in found if e["kind"] == "missing_grad"]
    assert missing, [(e["kind"], e["step"]) for e in found]
    assert missing[0]["step"] <= 4, "step 0 comes before any backward; from step 1 on each follows one"
    assert sorted(missing[0]["details"]["parameters"]) == sorted(TRAINABLE)
    assert "cleared between the backward and the step" in missing[0]["message"]
    assert "zero_grad(), backward (manual_backward(loss)), then step()" in missing[0]["message"]
    assert missing[0]["details"]["cause"]["where"] == "gradients_cleared"
    assert first_in_report(tmp_path) == "missing_grad"


def test_manual_optimization_in_the_documented_order_is_quiet(tmp_path: Path) -> None:
    found = fit(tmp_path, ManualOrder(wrong=False), DebugConfig(gradient_checking_frequency=1), 12)
    assert found == [], [(e["kind"], e["step"], e["message"][:160]) for e in found]


def test_under_accelerate_the_loss_rebuilt_from_its_value_is_named_alike(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness.toolkit import regression_data, run_dir

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = TinyRegressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(regression_data(), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    debugger = AccelerateDebugger(accelerator, model, optimizer, DebugConfig(print_summary=False), total_steps=12)
    try:
        with debugger:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                debugger.backward(torch.tensor(loss.item(), requires_grad=True))
                optimizer.step()
                optimizer.zero_grad()
                if debugger.step >= 12:
                    break
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    missing = [e for e in events if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    assert missing and missing[0]["step"] == 0, [(e["kind"], e["step"]) for e in events]
    assert missing[0]["details"]["cause"]["where"] == "loss_without_parameters"
