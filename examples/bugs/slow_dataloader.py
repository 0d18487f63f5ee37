"""Planted bug: a slow data loader (seed checklist, "Slow Training", cause a: data loading bottleneck).

The dataset does expensive work in ``__getitem__`` (here a sleep standing in for decoding and
augmentation) and the DataLoader runs it in the training process (``num_workers=0``), so the
model waits for every batch. PerformanceProfilerCallback reports ``dataloader_bottleneck`` with
the share of the step spent waiting, the loader's settings and what to change.

Fix: ``DataLoader(..., num_workers=N, persistent_workers=True)`` (and ``pin_memory=True`` on
GPU), or move the expensive work out of ``__getitem__`` (preprocess once).

Run: ``python examples/bugs/slow_dataloader.py [OUTPUT_DIR]`` (a few seconds on CPU).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import show, train  # noqa: E402

from lightning_debug import PerformanceProfilerCallback  # noqa: E402


class SlowDataset(Dataset):
    def __init__(self, samples: int = 1024) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=generator)
        self.y = self.x[:, :1] * 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.001)  # the bug: 1 ms of "decoding" per sample, in the training process
        return self.x[index], self.y[index]


class SmallRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(output_dir: str | Path = "bug_runs", steps: int = 20) -> dict[str, Any]:
    torch.manual_seed(0)
    loader = DataLoader(SlowDataset(), batch_size=16, shuffle=True, num_workers=0)
    callback = PerformanceProfilerCallback(performance_profiling_frequency=1)
    debug_dir = train(SmallRegressor(), loader, [callback], output_dir, "slow_dataloader", steps)
    return show("1 ms of work per sample in __getitem__ with num_workers=0", debug_dir, "dataloader_bottleneck",
                "num_workers")


if __name__ == "__main__":
    main(*sys.argv[1:2])
