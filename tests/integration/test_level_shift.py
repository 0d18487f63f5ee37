"""Steps that become slower for good, by design: a batch-size schedule makes every step from one on
several times slower. That is a new level, told as an info that names the input's growth, and never a
``slow_step`` warning; slow steps that end are still the warning. Real Trainer runs on CPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, PerformanceProfilerCallback
from tests.harness.toolkit import debug_dir, make_trainer, read_events

pytestmark = pytest.mark.timeout(180)

SMALL, LARGE, RAMP_STEP, STEPS = 16, 768, 30, 80


class BatchSizeRamp(Dataset):
    """One whole batch per item: ``SMALL`` rows before ``RAMP_STEP``, ``LARGE`` after (a batch-size warm-up)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = SMALL if index < RAMP_STEP else LARGE
        generator = torch.Generator().manual_seed(index)
        return torch.randn(rows, 256, generator=generator), torch.randn(rows, 1, generator=generator)


class WideRegressor(pl.LightningModule):
    def __init__(self, stall_steps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
        self.stall_steps = stall_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step in self.stall_steps:
            time.sleep(0.4)  # a blocking call in user code on a few steps in a row
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(BatchSizeRamp(), batch_size=None)


def slow_steps(tmp_path: Path, model: WideRegressor) -> list[dict[str, Any]]:
    pl.seed_everything(0)
    callback = PerformanceProfilerCallback(DebugConfig(performance_profiling_frequency=1))
    trainer = make_trainer(tmp_path, [callback], max_steps=STEPS, limit_val_batches=0)
    trainer.fit(model)
    return [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step" and e.get("episode") != "end"]


def test_a_batch_size_schedule_is_a_new_level_not_a_slow_step(tmp_path: Path) -> None:
    found = slow_steps(tmp_path, WideRegressor())
    assert not [e for e in found if e["severity"] != "info"], [e["message"] for e in found]
    shifts = [e for e in found if "shift_step" in e["details"]]
    assert [e["details"]["shift_step"] for e in shifts] == [RAMP_STEP], [e["message"] for e in found]
    details = shifts[0]["details"]
    assert details["elements_ratio"] == pytest.approx(LARGE / SMALL) and details["factor"] > 3
    assert f"{LARGE / SMALL:.1f}x the elements" in shifts[0]["message"]


def test_slow_steps_in_a_row_that_end_are_still_a_warning(tmp_path: Path) -> None:
    found = slow_steps(tmp_path, WideRegressor(stall_steps=(12, 13, 14)))
    warnings = [e for e in found if e["severity"] == "warning"]
    assert [e["step"] for e in warnings] == [14], [e["message"] for e in found]
    assert warnings[0]["details"]["slow_steps"] == 3 and warnings[0]["details"]["phase"] == "forward"
