"""The planted-bug demo behind ``lightning-debug demo``: a small CPU run whose loss takes ``log(0)``.

It trains an MLP with all four callbacks on at level ADVANCED, plants a ``log`` of zero in the loss
from step 40, and prints progress lines with each finding as it happens (the replay of the first bad
step names ``torch.log`` at its source line), then what lightning-debug found, where the files went
and how to open them. The planted ``torch.log`` stays on line 40: docs/quickstart.md quotes it.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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


class ProgressLines(pl.Callback):
    """A line every eighth of the run (findings have their own console line, from the plugin)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.every = max(1, steps // 8)
        self.started = time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        done = trainer.global_step
        if done % self.every == 0 or done == self.steps:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
            # steps are numbered from 0, as in the findings: the step just done is global_step - 1
            print(f"  step {done - 1:>4}  loss {value:9.4g}  {time.monotonic() - self.started:5.1f} s", flush=True)


def run_demo(output: str | Path = "demo_output", steps: int = 80, nan_step: int = 40, mode: str = "warn") -> Path:
    """Train, report, and return the debug output directory."""
    from lightning_debug import AnomalyError, DebugConfig, debug_callbacks

    torch.manual_seed(0)
    inputs = torch.randn(2048, 16)
    targets = inputs[:, :1] * 2.0 + 0.1 * torch.randn(2048, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)
    # ADVANCED replays the first NaN step to name its cause; its default torch.profiler window is left
    # out here (profile_steps length 0) because the profiler prints to the console.
    config = DebugConfig(anomaly_detection_mode=mode, level="advanced", gradient_checking_frequency=5,
                         memory_profiling_frequency=5, performance_profiling_frequency=5, log_gradients=True,
                         profile_steps=(0, 0))
    logger = TensorBoardLogger(str(output), name="demo")
    print(f"Training {steps} steps (0-{steps - 1}) on CPU at level ADVANCED; the loss takes log(0) from step "
          f"{nan_step} on ...", flush=True)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the demo's own lines only: no GPU/TPU lines, no tips
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger,
                                 callbacks=[*debug_callbacks(config), ProgressLines(steps)], enable_checkpointing=False,
                                 enable_model_summary=False, enable_progress_bar=False, log_every_n_steps=5)
            trainer.fit(PlantedNaNModel(nan_step), loader)
        except AnomalyError as error:
            print(f"\nTraining stopped with AnomalyError, as anomaly_detection_mode='raise' asks: {error}")
        finally:
            lightning_log.setLevel(level)
    debug_dir = Path(trainer.log_dir) / config.debug_output_dir
    print_summary(debug_dir, Path(trainer.log_dir))
    return debug_dir


def print_summary(debug_dir: Path, log_dir: Path) -> None:
    """What to open next (the run's own summary printed the findings): only files the run wrote, each path whole
    on its line and quoted in the commands, ready to paste into a shell."""
    from lightning_debug.report.plots import INSTALL_HINT, PLOT_FILENAME
    from lightning_debug.report.summary import report_command

    report_path = debug_dir / "report.json"
    if not report_path.exists():
        print(f"No report in {debug_dir}.")
        return
    report = json.loads(report_path.read_text())
    first = next(iter(report["findings"]), None)
    print("\nNext:")
    if first is not None and (debug_dir / "report.md").is_file():
        print(f"  - read {debug_dir / 'report.md'}: `{first}` comes first, with where it happened and what to do")
    if (debug_dir / PLOT_FILENAME).is_file():
        print(f"  - look at {debug_dir / PLOT_FILENAME} (the loss, step time, memory, gradient norm, findings "
              "over steps)")
    else:
        print(f"  - {PLOT_FILENAME} was not drawn (it needs matplotlib): {INSTALL_HINT}, then "
              f"{report_command(debug_dir)}")
    print(f"  - tensorboard --logdir {shlex.quote(str(log_dir))}  then open CUSTOM SCALARS (your loss next to the "
          "debug charts, by area) and TEXT (this report, and each finding at its step)")
    print(f"  - programs: {report_path} and {debug_dir / 'events.jsonl'}")
