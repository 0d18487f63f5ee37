"""``repeated_batch`` through a real Trainer on one-hot inputs without labels (an autoencoder of categorical records):
every batch of one-hot rows sums to the same value and is mostly zeros at any few fixed positions, so a fingerprint of
the sum and a few spread values gave different batches one print (binarized images with a blank border, as a GAN or a
VAE trains on, did the same); shuffled records are quiet, and the same records drawn by two data-loader workers that
copy one NumPy generator are still named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_debug import DebugConfig
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(240)
FEATURES, CATEGORIES, SAMPLES = 8, 32, 4096
LOUD = ("warning", "error", "critical")


def one_hot_records(seed: int = 0) -> TensorDataset:
    """Eight categorical features, one-hot over 32 categories each, the second a function of the first."""
    g = torch.Generator().manual_seed(seed)
    categories = torch.randint(0, CATEGORIES, (SAMPLES, FEATURES), generator=g)
    categories[:, 1] = (categories[:, 0] * 7 + 3) % CATEGORIES
    return TensorDataset(F.one_hot(categories, CATEGORIES).float().reshape(SAMPLES, -1))


class SharedGenerator(Dataset):
    """Draws a random record from a NumPy generator made once: forked workers copy it and draw the same records."""

    def __init__(self, records: TensorDataset) -> None:
        (self.records,) = records.tensors
        self.rng = np.random.RandomState(0)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (self.records[int(self.rng.randint(len(self.records)))],)


class OneHotAutoencoder(pl.LightningModule):
    def __init__(self, shared_workers: bool = False) -> None:
        super().__init__()
        self.shared_workers = shared_workers
        self.net = nn.Sequential(nn.Linear(FEATURES * CATEGORIES, 32), nn.ReLU(), nn.Linear(32, FEATURES * CATEGORIES))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.net(x).reshape(-1, CATEGORIES)
        return F.cross_entropy(logits, x.reshape(-1, CATEGORIES).argmax(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        if self.shared_workers:
            return DataLoader(SharedGenerator(one_hot_records()), batch_size=64, num_workers=2, persistent_workers=True)
        return DataLoader(one_hot_records(), batch_size=64, shuffle=True)


def test_shuffled_one_hot_batches_are_not_repeats(tmp_path: Path) -> None:
    trainer = fit_seeded(tmp_path, OneHotAutoencoder(), all_four(DebugConfig(level="advanced")), max_steps=320)
    loud = [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD]
    assert loud == [], [(e["kind"], e["step"], e["message"][:200]) for e in loud]


def test_one_hot_records_drawn_twice_by_workers_sharing_a_generator_are_named(tmp_path: Path) -> None:
    trainer = fit_seeded(tmp_path, OneHotAutoencoder(shared_workers=True), all_four(DebugConfig(level="advanced")),
                         max_steps=220)
    found = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "repeated_batch" and e["severity"] == "warning"]
    assert found, [(e["kind"], e["step"]) for e in read_events(debug_dir(trainer))]
    assert found[0]["details"]["repeats"] >= 2
