"""Planted bug: vanishing gradients (seed checklist, "Vanishing Gradients").

Twelve sigmoid layers in a row: each multiplies the gradient by at most 0.25 on its way back, so
the layers near the input receive almost nothing and do not learn. GradientHealthCallback reports
``vanishing_grad`` naming those parameters input side first, and where the gradient is healthy
again.

Fix: ReLU/GELU instead of sigmoid/tanh, Kaiming/Xavier initialisation, normalization layers or
residual connections.

Run: ``python examples/bugs/vanishing_gradients.py [OUTPUT_DIR]`` (a few seconds on CPU).
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

from lightning_debug import GradientHealthCallback  # noqa: E402


class DeepSigmoidNet(pl.LightningModule):
    def __init__(self, depth: int = 12, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.Sigmoid()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Sigmoid()]  # the bug: saturating activations, no shortcuts
        self.layers = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(output_dir: str | Path = "bug_runs", steps: int = 30) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = torch.sin(x[:, :1])
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    callback = GradientHealthCallback(gradient_checking_frequency=1, gradient_vanishing_threshold=1e-6)
    debug_dir = train(DeepSigmoidNet(), loader, [callback], output_dir, "vanishing_gradients", steps)
    return show("twelve sigmoid layers in a row", debug_dir, "vanishing_grad", "parameters")


if __name__ == "__main__":
    main(*sys.argv[1:2])
