"""Planted bug: exploding gradients (seed checklist, "Exploding Gradients").

A deep ReLU MLP without normalization whose weights are initialised far too large
(``std=0.5`` for 64-wide layers, a gain of about 2.8 per layer): activations and gradients grow
by orders of magnitude through the depth. GradientHealthCallback reports ``exploding_grad`` with
the global norm, the largest per-parameter norms and a ``gradient_clip_val`` suggestion.

Fix: Kaiming/Xavier initialisation (the ``nn.Linear`` default), normalization layers, gradient
clipping (``Trainer(gradient_clip_val=1.0)``) and a lower learning rate.

Run: ``python examples/bugs/exploding_gradients.py [OUTPUT_DIR]`` (a few seconds on CPU).
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


class BadlyInitialisedMLP(pl.LightningModule):
    def __init__(self, depth: int = 6, width: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.layers = nn.Sequential(*layers, nn.Linear(width, 1))
        for module in self.layers:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.5)  # the bug: ~4x the stable scale for this width

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def main(output_dir: str | Path = "bug_runs", steps: int = 30) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    callback = GradientHealthCallback(gradient_checking_frequency=1, gradient_explosion_threshold=10.0)
    debug_dir = train(BadlyInitialisedMLP(), loader, [callback], output_dir, "exploding_gradients", steps)
    return show("weights initialised with std=0.5 in a 6-layer ReLU MLP without normalization", debug_dir,
                "exploding_grad", "parameters")


if __name__ == "__main__":
    main(*sys.argv[1:2])
