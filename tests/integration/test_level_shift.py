"""Steps that become slower for good, by design: a batch-size or sequence-length schedule makes every step
from one on several times slower, and the host's memory higher. That is a new level, told as an info that
names the input's growth, never a ``slow_step`` or ``memory_growth`` warning; slow steps that end are still
the warning. Real Trainer runs on CPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, PerformanceProfilerCallback, debug_callbacks
from tests.harness.toolkit import debug_dir, make_trainer, read_events

pytestmark = pytest.mark.timeout(180)

SMALL, LARGE, RAMP_STEP, STEPS = 16, 2048, 30, 80
"""A large step: 16 GFLOP, at least 100 ms on one thread of any CPU (the floor of a slow step is 50 ms over)."""


class BatchSizeRamp(Dataset):
    """One whole batch per item: ``SMALL`` rows before ``RAMP_STEP``, ``LARGE`` after (a batch-size warm-up)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = SMALL if index < RAMP_STEP else LARGE
        generator = torch.Generator().manual_seed(index)
        return torch.randn(rows, 256, generator=generator), torch.randn(rows, 1, generator=generator)


class WideRegressor(pl.LightningModule):
    def __init__(self, stall_steps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
        self.stall_steps = stall_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step in self.stall_steps:
            time.sleep(0.4)  # a blocking call in user code on a few steps in a row
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(BatchSizeRamp(), batch_size=None)


def slow_steps(tmp_path: Path, model: WideRegressor) -> list[dict[str, Any]]:
    pl.seed_everything(0)
    callback = PerformanceProfilerCallback(DebugConfig(performance_profiling_frequency=1))
    trainer = make_trainer(tmp_path, [callback], max_steps=STEPS, limit_val_batches=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the large step's time independent of the machine's cores
    try:
        trainer.fit(model)
    finally:
        torch.set_num_threads(threads)
    return [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step" and e.get("episode") != "end"]


def test_a_batch_size_schedule_is_a_new_level_not_a_slow_step(tmp_path: Path) -> None:
    found = slow_steps(tmp_path, WideRegressor())
    assert not [e for e in found if e["severity"] != "info"], [e["message"] for e in found]
    shifts = [e for e in found if "shift_step" in e["details"]]
    assert [e["details"]["shift_step"] for e in shifts] == [RAMP_STEP], [e["message"] for e in found]
    details = shifts[0]["details"]
    assert details["elements_ratio"] == pytest.approx(LARGE / SMALL) and details["factor"] > 3
    assert f"{LARGE / SMALL:.1f}x the elements" in shifts[0]["message"]


def test_slow_steps_in_a_row_that_end_are_still_a_warning(tmp_path: Path) -> None:
    found = slow_steps(tmp_path, WideRegressor(stall_steps=(12, 13, 14)))
    warnings = [e for e in found if e["severity"] == "warning"]
    assert [e["step"] for e in warnings] == [14], [e["message"] for e in found]
    assert warnings[0]["details"]["slow_steps"] == 3 and warnings[0]["details"]["phase"] == "forward"


class GrowingSequences(pl.LightningModule):
    """A small transformer encoder under a sequence-length schedule: 16, then 48, then 144 tokens, 100 steps each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
        self.out = nn.Linear(64, 100)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        return nn.functional.cross_entropy(self.out(self.encoder(self.embed(tokens))).flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 100, (8, length), generator=generator),)
                   for length in [16] * 100 + [48] * 100 + [144] * 100]
        return DataLoader(batches, batch_size=None)


def test_a_sequence_length_schedule_is_quiet_with_every_check_every_step(tmp_path: Path) -> None:
    """Each step slower and the host's memory higher from each change on: no warning (before, the heap's steps up
    read as a leak: memory_growth at step 282; with 64 and 256 tokens, also a slow_step at step 202)."""
    pl.seed_everything(0)
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=300, limit_val_batches=0)
    trainer.fit(GrowingSequences())
    events = read_events(debug_dir(trainer))
    assert not [(e["kind"], e["step"]) for e in events if e["severity"] in ("warning", "error", "critical")]


class BucketedSequences(GrowingSequences):
    """The same encoder on batches bucketed by length (8 to 256 tokens, shuffled): every few steps a batch takes
    ten times the median, by design."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.tensor([8, 16, 32, 64, 128, 256])[torch.randint(0, 6, (120,), generator=generator)]
        batches = [(torch.randint(0, 100, (8, int(length)), generator=generator),) for length in lengths]
        return DataLoader(batches, batch_size=None)


def test_batches_bucketed_by_length_are_no_slow_steps(tmp_path: Path) -> None:
    """No slow_step warning (before, one every few dozen steps with every step timed). A stall among such batches is
    still one: tests/unit/test_performance_rules.py plants it on any step and on the long batches only."""
    pl.seed_everything(0)
    callback = PerformanceProfilerCallback(DebugConfig(performance_profiling_frequency=1))
    trainer = make_trainer(tmp_path, [callback], max_steps=120, limit_val_batches=0)
    trainer.fit(BucketedSequences())
    warned = [e for e in read_events(debug_dir(trainer)) if e["severity"] == "warning"]
    assert not warned, [e["message"] for e in warned]
