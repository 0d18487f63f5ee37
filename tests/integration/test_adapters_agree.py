"""The same planted bugs through both adapters name the same kinds at the same steps.

Every optional fact an adapter gives the run (how long it runs, its schedulers, where an epoch ends) is
given by both, so no check goes silent under one of them: a non-finite loss at step 5, a layer no forward
calls (missing gradients from step 0) and a LambdaLR that reaches 0 at step 8 of 24 (a stall).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lightning_debug import DebugConfig, debug_callbacks  # noqa: E402
from lightning_debug.accelerate import AccelerateDebugger  # noqa: E402
from tests.harness.toolkit import (TinyRegressor, debug_dir, make_trainer, read_events, regression_data,  # noqa: E402
                                   run_dir)

STEPS = 24
LOG_ZERO_AT = 5
LR_ZERO_FROM = 8
CONFIG = DebugConfig(mode="full_debug", gradient_checking_frequency=1, save_plots=False, print_summary=False)


def lr_factor(step: int) -> float:
    return 1.0 if step < LR_ZERO_FROM else 0.0


class Planted(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(unused_layer=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + torch.log(torch.zeros(())) if self.trainer.global_step == LOG_ZERO_AT else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16, shuffle=False)


def named(events: list[dict[str, Any]]) -> dict[str, int]:
    """Each kind of warning or above and the step its first episode starts."""
    first: dict[str, int] = {}
    for event in events:
        if event["severity"] in ("warning", "error", "critical") and event.get("episode") in (None, "start"):
            first.setdefault(event["kind"], event["step"])
    return first


def lightning_run(root: Path) -> dict[str, int]:
    torch.manual_seed(0)
    trainer = make_trainer(root, debug_callbacks(CONFIG), max_steps=STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Planted())
    return named(read_events(debug_dir(trainer)))


def accelerate_run(root: Path) -> dict[str, int]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=str(root))
    model = Planted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loader = DataLoader(regression_data(), batch_size=16, shuffle=False)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    debugger = AccelerateDebugger(accelerator, model, optimizer, CONFIG, train_dataloader=loader, total_steps=STEPS,
                                  lr_scheduler=schedule)
    with debugger:
        while debugger.step < STEPS:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                if debugger.step == LOG_ZERO_AT:
                    loss = loss + torch.log(torch.zeros(()))
                debugger.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
                if debugger.step >= STEPS:
                    break
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return named(read_events(run_dir(root / "debug_outputs")))


def test_both_adapters_name_the_same_planted_kinds_at_the_same_steps(tmp_path: Path) -> None:
    lightning, accelerate = lightning_run(tmp_path / "lightning"), accelerate_run(tmp_path / "accelerate")
    assert {"nonfinite_loss", "missing_grad", "learning_stalled"} <= set(lightning), lightning
    assert lightning["nonfinite_loss"] == LOG_ZERO_AT and lightning["missing_grad"] == 0
    assert lightning.pop("nonfinite_activation") == LOG_ZERO_AT, "the replay names the log in training_step"
    assert accelerate == lightning, "the Accelerate replay recomputes the model's forward, not the loop's loss"
