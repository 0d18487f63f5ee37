"""Planted bug: a layer that never takes part in the forward (seed checklist, "Verify gradients are flowing").

The model defines an auxiliary head that ``forward`` forgot to use: its parameters never receive
a gradient and never change, silently. GradientHealthCallback reports ``missing_grad`` naming them
(under DDP the same bug makes backward fail unless ``find_unused_parameters`` is on).

Fix: use the layer, delete it, or freeze it with ``requires_grad_(False)``.

Run: ``python examples/bugs/unused_layer.py [OUTPUT_DIR]`` (a few seconds on CPU).
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


class ModelWithForgottenHead(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.aux_head = nn.Linear(32, 1)  # the bug: defined, trained by the optimizer, never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(output_dir: str | Path = "bug_runs", steps: int = 20) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x[:, :1] * 2
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    callback = GradientHealthCallback(gradient_checking_frequency=5)
    debug_dir = train(ModelWithForgottenHead(), loader, [callback], output_dir, "unused_layer", steps)
    return show("`aux_head` defined in __init__ but never called in forward", debug_dir, "missing_grad",
                "parameters")


if __name__ == "__main__":
    main(*sys.argv[1:2])
