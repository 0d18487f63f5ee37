"""Issue 45: dropout still active at evaluation (TrainCheck's silent error), named at the defaults by any callback
alone as ``train_mode_in_eval`` with the user's source line, beside its twins: ``training=self.training``, an
``nn.Dropout`` module, and BatchNorm in eval mode, all quiet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_debug import AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback
from tests.harness.toolkit import TinyRegressor, debug_dir, fit_seeded, read_events, read_report, regression_data


class DropoutNet(TinyRegressor):
    """``dropout``: ``functional`` (``F.dropout(h, 0.5)``: on in validation, the bug), ``fixed``
    (``training=self.training``), ``module`` (an ``nn.Dropout``), ``train_in_forward`` (an ``nn.Dropout`` and a
    BatchNorm put back in train mode inside ``forward``: the bug again), ``batchnorm`` (a BatchNorm, healthy)."""

    def __init__(self, dropout: str) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.dropout = dropout
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(16) if dropout in ("train_in_forward", "batchnorm") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.dropout == "functional":
            h = F.dropout(h, 0.5)
        elif self.dropout == "fixed":
            h = F.dropout(h, 0.5, training=self.training)
        elif self.dropout == "module":
            h = self.drop(h)
        elif self.dropout == "train_in_forward":
            self.drop.train()
            self.norm.train()
            h = self.norm(self.drop(h))
        else:
            h = self.norm(h)
        return self.head(torch.relu(self.hidden(h)))

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(64, seed=1), batch_size=16)


def fit(tmp_path: Path, model: DropoutNet, callback: Any) -> tuple[list[dict[str, Any]], Path]:
    trainer = fit_seeded(tmp_path, model, [callback], max_steps=8, val_check_interval=4)
    return read_events(debug_dir(trainer)), debug_dir(trainer)


def loud(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in events if e["severity"] in {"warning", "error", "critical"}]


@pytest.mark.parametrize("callback", [AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback])
def test_functional_dropout_left_on_in_validation_is_named_with_its_line_by_any_callback_alone(
        tmp_path: Path, callback: type) -> None:
    events, directory = fit(tmp_path, DropoutNet("functional"), callback())
    named = [e for e in events if e["kind"] == "train_mode_in_eval"]
    assert loud(events) == [("train_mode_in_eval", 0)], loud(events)
    call = named[0]["details"]["calls"][0]
    assert call["operation"] == "torch.nn.functional.dropout" and call["count"] == 1
    assert call["source"]["file"] == __file__ and call["source"]["code"] == "h = F.dropout(h, 0.5)"
    assert "training=self.training" in named[0]["message"]
    assert "train_mode_in_eval" in (directory / "report.md").read_text()


def test_modules_put_back_in_train_mode_inside_forward_are_named(tmp_path: Path) -> None:
    events, _ = fit(tmp_path, DropoutNet("train_in_forward"), GradientHealthCallback())
    named = [e for e in events if e["kind"] == "train_mode_in_eval"]
    assert named, loud(events)
    assert {c["operation"] for c in named[0]["details"]["calls"]} == {"torch.nn.functional.dropout",
                                                                      "torch.nn.functional.batch_norm"}


@pytest.mark.parametrize("dropout", ["fixed", "module", "batchnorm"])
def test_dropout_and_batchnorm_that_follow_the_mode_are_quiet(tmp_path: Path, dropout: str) -> None:
    trainer = fit_seeded(tmp_path, DropoutNet(dropout), [GradientHealthCallback()], max_steps=8, val_check_interval=4)
    events = read_events(debug_dir(trainer))
    assert loud(events) == [] and not [e for e in events if e["kind"] == "train_mode_in_eval"]
    assert read_report(debug_dir(trainer))["sections"]["loop"]["evaluation_watched"] is True


@pytest.mark.parametrize("fixed", [False, True])
def test_an_accelerate_loop_that_evaluates_with_dropout_on_is_named(tmp_path: Path, fixed: bool) -> None:
    """Under Accelerate the first forward of the model in eval mode is the evaluation batch watched."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness.toolkit import run_dir

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.inp(x))
            return self.head(F.dropout(h, 0.5, training=self.training) if fixed else F.dropout(h, 0.5))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(regression_data(), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with AccelerateDebugger(accelerator, model, optimizer, print_summary=False, save_plots=False) as debugger:
        for step, (x, y) in enumerate(loader):
            debugger.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if step == 3:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    named = [(e["kind"], e["step"]) for e in events if e["kind"] == "train_mode_in_eval"]
    assert loud(events) == named and named == ([] if fixed else [("train_mode_in_eval", 4)]), loud(events)
