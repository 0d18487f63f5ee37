"""Planted bug: a memory leak from kept graphs (seed checklist, "Memory Leaks", cause a).

Each step computes a training metric with the model and appends it to a list for the epoch
summary without ``.item()`` or ``.detach()``: every entry keeps its autograd graph, and with it
the activations that graph saved, so memory grows every step until the process runs out.
MemoryProfilerCallback reports ``memory_growth`` with the growth per step, when memory would
run out, and which tensors pile up (their ``grad_fn``), with the fix.

Fix: ``self.train_metrics.append(metric.item())`` (or ``metric.detach()``), or compute the
metric under ``torch.no_grad()``.

Run: ``python examples/bugs/memory_leak_kept_graphs.py [OUTPUT_DIR]`` (about ten seconds on CPU;
a leak is only called a leak after several readings a few steps apart).
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

from lightning_debug import MemoryProfilerCallback  # noqa: E402


class KeepsMetricGraphs(pl.LightningModule):
    def __init__(self, features: int = 2048) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 1))
        self.train_metrics: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.train_metrics.append(nn.functional.l1_loss(self.net(x), y))  # the bug: keeps the graph alive
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(output_dir: str | Path = "bug_runs", steps: int = 120) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2048, 2048)
    y = x[:, :1]
    loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)
    callback = MemoryProfilerCallback(memory_profiling_frequency=8)
    debug_dir = train(KeepsMetricGraphs(), loader, [callback], output_dir, "memory_leak_kept_graphs", steps)
    return show("a per-step metric appended to a list with its autograd graph", debug_dir, "memory_growth",
                "tensors")


if __name__ == "__main__":
    main(*sys.argv[1:2])
