"""LightningCLI entry point for the example configurations; CPU, seconds per run.

    python examples/train.py fit --config examples/configs/anomaly.yaml
    python examples/train.py fit --config examples/configs/full.yaml --print_config
    python examples/train.py fit --help

Each file in ``examples/configs/`` turns on one area of lightning-debug (``full.yaml`` all four)
and plants the bug that area finds through the switches of :class:`ExampleModel` and
:class:`ExampleData` (all off by default). For your own project copy the ``trainer.callbacks``
block into your configuration and drop the ``model``/``data`` switches.

A bad value is a usage error of four lines (exit code 2): the key with its whole path, the value given,
what is allowed and a tip to ``--help`` (``CompactArgumentParser``, see docs/configuration.md).

Runs go to ``lightning_logs/<config name>/version_N``: TensorBoard files, and ``debug_outputs/``
with events.jsonl, report.json, report.md and debug_analysis.png.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug.callbacks.cli import CompactArgumentParser


class ExampleModel(pl.LightningModule):
    """A small MLP regressor whose bugs are planted by switches (all off by default).

    Args:
        features: Input features; must match ``data.features``.
        hidden: Width of the hidden layers.
        lr: Adam learning rate.
        log_zero_from_step: From this optimizer step on, the loss adds ``log(0)``, as a
            log-likelihood without an epsilon does: a NaN/Inf loss. ``null`` never.
        unused_layer: Define a layer that ``forward`` never uses: its parameters get no gradient.
        keep_graphs: Keep a training metric per step in a list without ``.item()`` or ``.detach()``:
            each one holds its autograd graph and the activations it saved, the classic memory leak.
    """

    def __init__(self, features: int = 16, hidden: int = 64, lr: float = 1e-3, log_zero_from_step: int | None = None,
                 unused_layer: bool = False, keep_graphs: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))
        self.unused = nn.Linear(hidden, hidden) if unused_layer else None
        self.kept_metrics: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        start = self.hparams.log_zero_from_step
        if start is not None and self.global_step >= start:
            loss = loss - torch.log(torch.zeros((), device=loss.device))
        if self.hparams.keep_graphs:
            self.kept_metrics.append(nn.functional.l1_loss(self(x), y))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class RegressionDataset(Dataset):
    """``samples`` random points of a noisy linear function; ``delay_ms`` of sleep per sample."""

    def __init__(self, samples: int, features: int, delay_ms: float, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, features, generator=generator)
        weights = torch.randn(features, 1, generator=generator)
        self.targets = self.inputs @ weights + 0.1 * torch.randn(samples, 1, generator=generator)
        self.delay_s = delay_ms / 1000

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inputs[index], self.targets[index]


class ExampleData(pl.LightningDataModule):
    """Random regression data.

    Args:
        samples: Number of training samples.
        features: Input features; must match ``model.features``.
        batch_size: Samples per batch.
        num_workers: DataLoader worker processes.
        sample_delay_ms: Sleep per sample in ``__getitem__``: a slow data pipeline (0 for none).
    """

    def __init__(self, samples: int = 1024, features: int = 16, batch_size: int = 32, num_workers: int = 0,
                 sample_delay_ms: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        dataset = RegressionDataset(hp.samples, hp.features, hp.sample_delay_ms)
        return DataLoader(dataset, batch_size=hp.batch_size, shuffle=True, num_workers=hp.num_workers,
                          persistent_workers=hp.num_workers > 0)


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """The LightningCLI of the examples; ``args`` as on the command line (None: ``sys.argv``).

    ``CompactArgumentParser`` prints a bad value as the key, the value and what is allowed, in four lines,
    instead of jsonargparse's usage synopsis and nested Union explanation (about 80).
    """
    return LightningCLI(ExampleModel, ExampleData, args=args, run=run, seed_everything_default=0,
                        save_config_kwargs={"overwrite": True}, parser_class=CompactArgumentParser)


if __name__ == "__main__":
    cli_main()
