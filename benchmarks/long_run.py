"""Bounded memory over a long run: 100,000 optimizer steps of a tiny model with all four callbacks
checking every step, the loss NaN on every step from a chosen step on (the worst case for the events
file), and the process's RSS sampled along the way.

    python benchmarks/long_run.py                  # 100,000 steps (several minutes on 2 cores)
    python benchmarks/long_run.py --steps 20000

It prints the RSS samples, the growth over the second half of the run, and the size of events.jsonl.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, debug_callbacks


class Endless(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size
        self.x = torch.randn(64, 8)
        self.y = torch.randn(64, 1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index % 64], self.y[index % 64]


class Tiny(pl.LightningModule):
    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.nan_from = nan_from

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step >= self.nan_from:
            loss = loss + torch.log(torch.zeros(()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RssSampler(pl.Callback):
    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[tuple[int, float, float]] = []
        self.process = psutil.Process(os.getpid())
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            rss_mb = self.process.memory_info().rss / 2**20
            self.samples.append((trainer.global_step, rss_mb, time.perf_counter() - self.start))
            print(f"step {trainer.global_step:>7}: RSS {rss_mb:8.1f} MB, {self.samples[-1][2]:7.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--nan-from", type=int, default=50_000, help="the loss is NaN from this step on")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ld-long-"))
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1, save_plots=False, print_summary=False)
    sampler = RssSampler(max(1, args.steps // args.samples))
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=CSVLogger(str(root)),
                         log_every_n_steps=1000, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[*debug_callbacks(config), sampler])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(args.nan_from), DataLoader(Endless(args.steps * 16), batch_size=16))
    events = Path(trainer.log_dir) / "debug_outputs" / "events.jsonl"
    lines = events.read_text().splitlines() if events.exists() else []
    half = [rss for step, rss, _ in sampler.samples if step >= args.steps // 2]
    print(f"\n{args.steps} steps in {sampler.samples[-1][2]:.0f} s; RSS over the second half: "
          f"{min(half):.1f}-{max(half):.1f} MB (growth {half[-1] - half[0]:+.1f} MB)")
    print(f"events.jsonl: {len(lines)} lines, {events.stat().st_size if events.exists() else 0} bytes "
          f"(the loss was NaN on {args.steps - args.nan_from} steps)")
    print(f"files under {root}")


if __name__ == "__main__":
    main()
