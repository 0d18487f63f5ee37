"""Lightning's precisions for a healthy model, with all four callbacks at the defaults and at ADVANCED, and a check that fails
inside the user's forward.

``precision="64-true"`` (a double model) stopped training at its first measured forward: the activation statistics
asked ``vector_norm`` to narrow a double to float32, inside a forward hook no guard covered. The statistics now
accumulate a double in double, and a forward hook that fails is a failed check, as any other: one warning, training
goes on. (``bf16-true`` is left out: Adam's steps of 1e-3 on a bias near 0.3 are under bf16's spacing there, and
``frozen_param`` says so, rightly.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import DebugConfig
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, read_events, read_report

pytestmark = pytest.mark.timeout(240)
LOUD = ("warning", "error", "critical")


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        return DataLoader(TensorDataset(x, x[:, :4].argmax(-1)), batch_size=64, shuffle=True)


@pytest.mark.parametrize("level", ["intermediate", "advanced"])
@pytest.mark.parametrize("precision", ["64-true", "32-true", "bf16-mixed"])
def test_every_precision_trains_to_the_end_without_a_finding(tmp_path: Path, precision: str, level: str) -> None:
    trainer = fit_seeded(tmp_path, Classifier(), all_four(DebugConfig(level=level)), max_steps=120,
                         precision=precision)
    assert trainer.global_step == 120
    report = read_report(debug_dir(trainer))
    assert report["failed_checks"] == {}, report["failed_checks"]
    loud = [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD]
    assert loud == [], [(e["kind"], e["step"], e["message"][:200]) for e in loud]


def test_a_check_that_fails_inside_the_forward_is_one_warning_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr("lightning_debug.monitors.activations.output_stats", broken)
    trainer = fit_seeded(tmp_path, Classifier(), all_four(DebugConfig(level="advanced")), max_steps=40)
    assert trainer.global_step == 40
    failed = read_report(debug_dir(trainer))["failed_checks"]
    assert "ActivationMonitor.observe" in failed and all(name.startswith("ActivationMonitor.") for name in failed)
    assert all(set(entry["reasons"]) == {"RuntimeError: a bug in a check"} for entry in failed.values()), failed
    warned = [r.getMessage() for r in caplog.records if "ActivationMonitor.observe failed" in r.getMessage()]
    assert len(warned) == 1, warned
