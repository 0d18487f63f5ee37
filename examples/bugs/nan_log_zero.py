"""Planted bug: NaN from the log of zero (seed checklist, "NaN or Inf in loss", cause c).

A hand-written binary cross-entropy ``-(y*log(p) + (1-y)*log(1-p))`` on a sigmoid output: once the
model is confident, ``p`` rounds to exactly 1.0 in float32, ``log(1 - p)`` is ``-inf`` and
``0 * -inf`` is NaN. AnomalyDetectionCallback reports ``nonfinite_loss`` at the first such step, and
``nonfinite_grad`` naming the parameters the NaN reached.

Fix: ``torch.nn.functional.binary_cross_entropy_with_logits(logits, y)`` (stable), or clamp:
``torch.log(p.clamp_min(1e-7))``.

Run: ``python examples/bugs/nan_log_zero.py [OUTPUT_DIR]`` (a few seconds on CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import show, train  # noqa: E402

from lightning_debug import AnomalyDetectionCallback  # noqa: E402


class ConfidentClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        p = torch.sigmoid(self.classifier(self.body(x))).squeeze(1)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # the bug: log(0) once p == 1.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3)


def main(output_dir: str | Path = "bug_runs", steps: int = 40) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(512, 8) * 6  # widely separated classes: the model becomes certain within a few steps
    y = (x[:, 0] > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    debug_dir = train(ConfidentClassifier(), loader, [AnomalyDetectionCallback(anomaly_detection_mode="warn")],
                      output_dir, "nan_log_zero", steps)
    return show("log(1 - p) with p == 1.0 in a hand-written binary cross-entropy", debug_dir, "nonfinite_loss",
                "ranks")


if __name__ == "__main__":
    main(*sys.argv[1:2])
