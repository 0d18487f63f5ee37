"""What every planted-bug example shares: a quiet CPU Trainer with TensorBoard, and printing what was reported."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader


def train(model: pl.LightningModule, loader: DataLoader, callbacks: list[pl.Callback], output_dir: str | Path,
          name: str, steps: int) -> Path:
    """Fit ``model`` for ``steps`` optimizer steps on CPU; return the run's debug output directory."""
    logger = TensorBoardLogger(str(output_dir), name=name)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         log_every_n_steps=5, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the findings are printed below; the warnings would repeat them
        trainer.fit(model, loader)
    return Path(trainer.log_dir) / "debug_outputs"


def reported(debug_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The events of ``kind`` that started an episode (or stand alone), in order."""
    path = debug_dir / "events.jsonl"
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [event for event in events if event["kind"] == kind and event.get("episode") != "end"]


def show(planted: str, debug_dir: Path, kind: str, detail: str) -> dict[str, Any]:
    """Print the planted bug and what lightning-debug said about it; return the first such event (or {})."""
    events = reported(debug_dir, kind)
    print(f"\nPlanted: {planted}")
    if not events:
        print(f"lightning-debug reported no `{kind}` (run more steps?). Files: {debug_dir}")
        return {}
    first = events[0]
    print(f"lightning-debug reported `{kind}` ({first['severity']}) at step {first['step']} "
          f"from {first['callback']}:")
    print(f"  {first['message']}")
    value = first.get("details", {}).get(detail)
    if value is not None:
        print(f"  details.{detail}: {value}")
    print(f"Report: {debug_dir / 'report.md'}   Plots: {debug_dir / 'debug_analysis.png'}")
    return first
