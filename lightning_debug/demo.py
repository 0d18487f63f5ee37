"""The planted-bug demo behind ``lightning-debug demo``: a small CPU run whose loss takes ``log(0)``.

It trains an MLP with all four callbacks on, plants a ``log`` of zero in the loss from step 40, and
prints what lightning-debug found, where the files went and how to open them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _module_class() -> type:
    import lightning.pytorch as pl

    class PlantedNaNModel(pl.LightningModule):
        """A regression MLP; from ``nan_step`` on the loss adds ``log(0)`` as a careless log-likelihood would."""

        def __init__(self, nan_step: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
            self.nan_step = nan_step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            prediction = self.net(x)
            loss = nn.functional.mse_loss(prediction, y)
            if self.global_step >= self.nan_step:
                probability = torch.zeros_like(loss)
                loss = loss - torch.log(probability)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return PlantedNaNModel


def run_demo(output: str | Path = "demo_output", steps: int = 80, nan_step: int = 40, mode: str = "warn") -> Path:
    """Train, report, and return the debug output directory."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_debug import DebugConfig, debug_callbacks

    torch.manual_seed(0)
    inputs = torch.randn(2048, 16)
    targets = inputs[:, :1] * 2.0 + 0.1 * torch.randn(2048, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)
    config = DebugConfig(anomaly_detection_mode=mode, gradient_checking_frequency=5, memory_profiling_frequency=5,
                         performance_profiling_frequency=5, log_gradients=True)
    logger = TensorBoardLogger(str(output), name="demo")
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger, callbacks=debug_callbacks(config),
                         enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=5)
    print(f"Training {steps} steps on CPU; the loss takes log(0) from step {nan_step} on ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_module_class()(nan_step), loader)
    debug_dir = Path(trainer.log_dir) / config.debug_output_dir
    print_summary(debug_dir, Path(trainer.log_dir))
    return debug_dir


def print_summary(debug_dir: Path, log_dir: Path) -> None:
    report_path = debug_dir / "report.json"
    if not report_path.exists():
        print(f"No report in {debug_dir}.")
        return
    report = json.loads(report_path.read_text())
    print("\nWhat lightning-debug found:")
    if not report["findings"]:
        print("  nothing wrong")
    for kind, entry in report["findings"].items():
        print(f"  - {kind} [{entry['severity']}] first at step {entry['first_step']}: {entry['first_message']}")
    print(f"\nEvents, one JSON line each:  {debug_dir / 'events.jsonl'}")
    print(f"Report for people:           {debug_dir / 'report.md'}")
    print(f"Report for programs:         {report_path}")
    print(f"TensorBoard charts (debug/): tensorboard --logdir {log_dir}")
