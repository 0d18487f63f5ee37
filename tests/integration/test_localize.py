"""Naming the cause of a NaN (level=ADVANCED): planted causes, and replays that never change training."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_debug.monitors.anomaly.replay as anomaly_monitor
from lightning_debug import AnomalyDetectionCallback
from tests.harness.toolkit import (TinyRegressor, as_on_an_accelerator, debug_dir, make_trainer, read_events,
                                   regression_data)


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - 10.0)  # negative argument: NaN from finite inputs


class Planted(TinyRegressor):
    """``kind`` picks the bug, active from step ``start`` on."""

    def __init__(self, kind: str, start: int = 3, data: TensorDataset | None = None) -> None:
        super().__init__()
        self.kind, self.start, self.data = kind, start, data
        self.act = Sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(torch.relu(self.inp(x)))
        active = self.trainer.global_step >= self.start
        if self.kind == "sqrt_module" and active:
            h = self.act(h)
        if self.kind == "backward_only" and active:
            h = h + torch.sqrt(h * h * 0.0)  # forward finite (0), derivative of sqrt at 0 is infinite
        return self.head(torch.relu(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.kind == "log_zero" and self.trainer.global_step >= self.start:
            loss = loss + torch.log(torch.zeros_like(loss))
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data or regression_data(), batch_size=16, shuffle=False)


def fit(tmp_path: Path, model: pl.LightningModule, level: str = "advanced", mode: str = "skip", steps: int = 6,
        **kwargs: Any) -> list[dict[str, Any]]:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(level=level, anomaly_detection_mode=mode)],
                           max_steps=steps, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return [e for e in read_events(debug_dir(trainer)) if e.get("episode") == "start"]


def cause_of(events: list[dict[str, Any]], kind: str = "nonfinite_loss") -> dict[str, Any]:
    return next(e for e in events if e["kind"] == kind)["details"]["cause"]


def test_module_taking_sqrt_of_a_negative_is_named(tmp_path: Path) -> None:
    events = fit(tmp_path, Planted("sqrt_module"))
    activation = next(e for e in events if e["kind"] == "nonfinite_activation")
    assert activation["step"] == 3
    details = activation["details"]
    assert (details["module"], details["module_type"], details["operation"]) == ("act", "Sqrt", "torch.sqrt")
    assert details["source"]["file"].endswith("test_localize.py") and "torch.sqrt(x - 10.0)" in details["source"]["code"]
    assert details["inputs"]["nonfinite_count"] == 0 and details["outputs"]["nonfinite_count"] > 0
    assert "module `act` (Sqrt) produced NaN/Inf from finite inputs" in activation["message"]
    assert "clamp" in activation["message"]
    assert cause_of(events)["module"] == "act", "the loss event carries the cause too"


def test_log_of_zero_in_the_loss_names_the_term_and_line(tmp_path: Path) -> None:
    events = fit(tmp_path, Planted("log_zero"))
    cause = cause_of(events)
    assert cause["operation"] == "torch.log" and cause["source"]["function"] == "training_step"
    assert "torch.log(torch.zeros_like(loss))" in cause["source"]["code"]
    loss_event = next(e for e in events if e["kind"] == "nonfinite_loss")
    assert "the loss computation" in loss_event["message"] and "epsilon" in loss_event["message"]


def test_nan_in_the_input_batch_is_blamed_on_the_inputs(tmp_path: Path) -> None:
    data = regression_data()
    data.tensors[0][16 * 4 + 3, 2] = float("nan")  # sample 3 of batch 4 (no shuffling)
    events = fit(tmp_path, Planted("none", data=data))
    assert [e["step"] for e in events if e["kind"] == "nonfinite_loss"] == [4]
    cause = cause_of(events)
    assert cause["where"] == "inputs" and cause["inputs"]["nonfinite_count"] == 1
    assert "the batch itself contains NaN/Inf (inputs)" in next(e for e in events if e["kind"] == "nonfinite_loss")["message"]


def test_learning_rate_that_overflows_a_parameter_names_it_with_the_lr(tmp_path: Path) -> None:
    events = fit(tmp_path, TinyRegressor(lr=3e38), mode="stop")
    param_event = next(e for e in events if e["kind"] == "nonfinite_param")
    assert "head.weight" in param_event["details"]["parameters"]
    assert "lr 3e+38" in param_event["message"] and "in the optimizer step at step 0" in param_event["message"]


def test_backward_only_nan_names_the_backward_operation_and_forward_line(tmp_path: Path) -> None:
    events = fit(tmp_path, Planted("backward_only"))
    grad_event = next(e for e in events if e["kind"] == "nonfinite_grad")
    assert "the loss is finite" in grad_event["message"]
    cause = grad_event["details"]["cause"]
    assert cause["where"] == "backward" and cause["operation"] == "SqrtBackward0"
    assert "torch.sqrt(h * h * 0.0)" in cause["source"]["code"]
    assert not [e for e in events if e["kind"] == "nonfinite_loss"]


class NoisyNet(TinyRegressor):
    """Dropout and BatchNorm, so a replay that touched RNG or running statistics would show; NaN at one step."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(torch.relu(self.inp(x))))
        h = self.hidden(h)
        if self.trainer.global_step == 5:
            h = h * torch.sqrt(-torch.ones(()))
        return self.head(torch.relu(h))


def _train_noisy(tmp_path: Path, level: str) -> list[torch.Tensor]:
    pl.seed_everything(7, verbose=False)
    model = NoisyNet()
    fit(tmp_path, model, level=level, mode="skip", steps=12)
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def test_training_after_a_replay_is_bit_identical_to_training_without_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_localize = anomaly_monitor.localize
    monkeypatch.setattr(anomaly_monitor, "localize", lambda *a, **k: calls.append(1) or real_localize(*a, **k))
    replayed = _train_noisy(tmp_path / "advanced", "advanced")
    assert calls == [1]
    as_on_an_accelerator(monkeypatch)
    plain = _train_noisy(tmp_path / "basic", "basic")
    assert calls == [1], "level=BASIC replays only where it costs nothing: on the host"
    assert all(torch.equal(a, b) for a, b in zip(replayed, plain))


def test_one_replay_per_episode_and_its_cost_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_localize = anomaly_monitor.localize
    monkeypatch.setattr(anomaly_monitor, "localize", lambda *a, **k: calls.append(1) or real_localize(*a, **k))
    events = fit(tmp_path, Planted("sqrt_module", start=2), steps=10)
    assert calls == [1], "the NaN persists from step 2 to 9: one episode, one replay"
    assert cause_of(events)["replay_ms"] > 0
