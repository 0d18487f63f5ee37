"""A margin loss (hinge, triplet) is exactly 0 on a batch whose margins all hold, and then sends back no gradient
at all: every layer is exactly zero, on every step once the training set is separated. That is a model that has
learnt its task, not a vanishing gradient, and a median gradient norm of 0 is no level to judge a jump against.
Real Trainer runs with all four callbacks, every check every step; then the bug that looks the same from the
gradients (a loss that is flat in the model's output) with a loss that is not 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, read_events, read_report, regression_data

pytestmark = pytest.mark.timeout(180)

LOUD = ("warning", "error", "critical")
EVERY_STEP = dict(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                  performance_profiling_frequency=1)


class MarginClassifier(pl.LightningModule):
    """A ReLU MLP trained with a hinge loss on a linearly separable label (the sign of the first feature).

    ``rounded``: the bug, the prediction rounded before the loss, so the loss is flat in the output."""

    def __init__(self, rounded: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.rounded = rounded
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        label = torch.where(x[:, :1] > 0, 1.0, -1.0)
        score = self.net(x)
        if self.rounded:
            score = score.round()
        loss = torch.relu(1 - label * score).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=512), batch_size=16, shuffle=True)


def fit(root: Path, model: pl.LightningModule, steps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    trainer = fit_seeded(root, model, all_four(DebugConfig(**EVERY_STEP)), steps, log_every_n_steps=10)
    return read_events(debug_dir(trainer)), read_report(debug_dir(trainer))


def test_a_hinge_loss_at_zero_is_a_learnt_task_not_a_vanishing_gradient(tmp_path: Path) -> None:
    model = MarginClassifier()
    events, report = fit(tmp_path, model, 250)
    zeros = [step for step, loss in enumerate(model.losses) if loss == 0]
    assert len(zeros) >= 60, "the run must separate its batches for a while, or it tests nothing"
    assert report["failed_checks"] == {}
    assert [(e["kind"], e["severity"]) for e in events if e["severity"] in LOUD] == []


def test_a_loss_flat_in_the_output_is_named(tmp_path: Path) -> None:
    model = MarginClassifier(rounded=True)
    events, _ = fit(tmp_path, model, 30)
    assert min(model.losses) > 0
    vanishing = [e for e in events if e["kind"] == "vanishing_grad"]
    assert vanishing and vanishing[0]["severity"] == "warning"
    assert "the loss is flat in the model's output" in vanishing[0]["message"]
    assert vanishing[0]["details"]["dead_layers"] == ["net.0", "net.2", "net.4"]
