"""Buffers and complex inputs read like floating ones (issue 45, invariant 5): a finite 1e20 input that makes
BatchNorm's ``running_var`` Inf while the loss, gradients and weights stay finite is ``nonfinite_buffer`` at its step;
NaN in a complex64 batch is ``nonfinite_input``; healthy BatchNorm and complex models are quiet."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, DebugConfig, debug_callbacks
from tests.harness.toolkit import debug_dir, make_trainer, read_events, regression_data

pytestmark = pytest.mark.timeout(120)
LOUD = {"warning", "error", "critical"}


class HugeInputAt(pl.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear; at ``at`` one sample of the batch is 1e20 (finite): the batch
    variance is 1e40, Inf in float32, so ``running_var`` becomes Inf while the normalised output stays finite."""

    def __init__(self, at: int | None = 20) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.at = at
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == self.at:
            x = x.clone()
            x[0] = 1e20
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


def fit(root: Path, model: pl.LightningModule, mode: str, steps: int = 30, all_four: bool = False) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    callbacks = (debug_callbacks(DebugConfig(mode="full_debug", anomaly_detection_mode=mode)) if all_four
                 else [AnomalyDetectionCallback(anomaly_detection_mode=mode)])
    trainer = make_trainer(root, callbacks, max_steps=steps, limit_val_batches=0)
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("mode,all_four", [("warn", False), ("skip", False), ("warn", True)])
def test_a_finite_huge_input_that_breaks_running_var_is_nonfinite_buffer_at_its_step(tmp_path: Path, mode: str,
                                                                                     all_four: bool) -> None:
    model = HugeInputAt(at=20)
    trainer = fit(tmp_path, model, mode, all_four=all_four)
    assert all(math.isfinite(loss) for loss in model.losses), "the plant: the loss stays finite"
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the plant: the weights stay finite"
    events = read_events(debug_dir(trainer))
    buffers = [e for e in events if e["kind"] == "nonfinite_buffer" and e.get("episode") == "start"]
    assert buffers, [(e["step"], e["kind"]) for e in events]
    first = buffers[0]
    assert first["step"] == 20 and first["severity"] == "error"
    assert first["details"]["buffers"] == ["net.1.running_var"] and first["details"]["modules"] == ["BatchNorm1d"]
    assert "`net.1.running_var` (BatchNorm1d)" in first["message"]
    assert {e["kind"] for e in events if e["severity"] in LOUD} == {"nonfinite_buffer"}
    if mode == "skip":
        assert torch.isfinite(model.net[1].running_var).all(), "the dropped step's statistics are put back"
        anomaly = next(c for c in trainer.callbacks if isinstance(c, AnomalyDetectionCallback))
        assert trainer.global_step == 30 and anomaly.monitor.skipped_steps == 1
        assert len(buffers) == 1
    else:
        assert not torch.isfinite(model.net[1].running_var).all()


@pytest.mark.parametrize("mode", ["warn", "skip"])
def test_a_healthy_batchnorm_model_is_quiet(tmp_path: Path, mode: str) -> None:
    trainer = fit(tmp_path, HugeInputAt(at=None), mode)
    assert [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD] == []


class ComplexSignal(pl.LightningModule):
    """A regression from complex64 signals (their real and imaginary parts to a linear layer); with ``nan_at``, one
    sample of the data is NaN in its imaginary part."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(16, 1)
        self.nan_at = nan_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        signal, y = batch
        features = torch.view_as_real(signal).flatten(1)
        return torch.nn.functional.mse_loss(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        signal = torch.randn(256, 8, dtype=torch.complex64, generator=generator)
        y = signal.real.sum(dim=1, keepdim=True)
        if self.nan_at is not None:
            signal[self.nan_at, 2] = complex(1.0, float("nan"))
        return DataLoader(TensorDataset(signal, y), batch_size=16)


def test_nan_in_a_complex_batch_is_nonfinite_input(tmp_path: Path) -> None:
    trainer = fit(tmp_path, ComplexSignal(nan_at=16 * 5 + 3), "warn", steps=10)
    events = read_events(debug_dir(trainer))
    inputs = [e for e in events if e["kind"] == "nonfinite_input" and e.get("episode") == "start"]
    assert inputs and inputs[0]["step"] == 5, [(e["step"], e["kind"]) for e in events]
    assert "batch[0]" in inputs[0]["message"] and "3" in str(inputs[0]["details"])


def test_a_healthy_complex_model_is_quiet(tmp_path: Path) -> None:
    trainer = fit(tmp_path, ComplexSignal(), "warn", steps=20)
    assert [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD] == []
