"""report.json / report.md order (issue 25): within a root cause's group the consequences follow the chain
of causes. The plant: a triplet loss with ``sqrt`` of a squared distance that is 0 (an anchor paired with
itself as its positive): the loss is finite, its gradient NaN, the update makes the weights NaN and the
next loss NaN. Real Trainer runs on CPU."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback
from tests.harness.toolkit import debug_dir, make_trainer, read_events

pytestmark = pytest.mark.timeout(120)


class TripletEmbedder(pl.LightningModule):
    """Embeds 16 features into 8; from ``zero_from`` on the positive is the anchor itself (distance 0)."""

    def __init__(self, zero_from: int = 3) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.zero_from = zero_from
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        anchor, positive, negative = batch
        if self.trainer.global_step >= self.zero_from:
            positive = anchor
        a, p, n = self.net(anchor), self.net(positive), self.net(negative)
        d_pos = ((a - p) ** 2).sum(dim=1).sqrt()
        d_neg = ((a - n) ** 2).sum(dim=1).sqrt()
        loss = torch.relu(d_pos - d_neg + 1.0).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = [torch.randn(256, 16, generator=generator) for _ in range(3)]
        return DataLoader(TensorDataset(*data), batch_size=32)


def fit(root: Path, level: str | None) -> tuple[pl.Trainer, TripletEmbedder]:
    pl.seed_everything(0, verbose=False)
    model = TripletEmbedder()
    config = DebugConfig(level=level) if level else DebugConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(root, [AnomalyDetectionCallback(config), GradientHealthCallback(config)], max_steps=8)
        trainer.fit(model)
    return trainer, model


@pytest.mark.parametrize("level", [None, "advanced"])
def test_consequences_follow_the_chain_of_causes_in_report_json_and_md(tmp_path: Path, level: str | None) -> None:
    trainer, model = fit(tmp_path, level)
    assert model.losses[3] == model.losses[3], "the plant: the loss at the first zero distance is finite"
    report = json.loads((debug_dir(trainer) / "report.json").read_text())
    findings = report["findings"]
    order = list(findings)
    for kind, entry in findings.items():
        cause = entry.get("consequence_of")
        if cause in findings:
            assert order.index(cause) < order.index(kind), (kind, cause, order)
    assert "nonfinite_grad" in findings and "nonfinite_param" in findings
    markdown = (debug_dir(trainer) / "report.md").read_text()
    headings = [line.split("`")[1] for line in markdown.splitlines() if line.startswith("### ")]
    assert headings == order


def test_the_healthy_triplet_embedder_is_quiet_at_advanced(tmp_path: Path) -> None:
    """Its last bias drops out of every distance, so its gradient is float32 rounding noise and SGD's update
    of it is below what the weights can hold: not a frozen parameter (it was ``frozen_param`` at step 0)."""
    pl.seed_everything(0, verbose=False)
    model = TripletEmbedder(zero_from=10**9)
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(level="advanced"), GradientHealthCallback(level="advanced")],
                           max_steps=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    loud = [(e["kind"], e["step"]) for e in read_events(debug_dir(trainer))
            if e["severity"] in ("warning", "error", "critical")]
    assert loud == []
    assert len(model.losses) == 8
