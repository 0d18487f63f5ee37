"""Lightning's ``Tuner`` before a fit: its learning-rate and batch-size finders train inside a fit of their
own, with the trainer's callbacks swapped out, and end it from ``on_fit_start``. That fit leaves no report
and no console summary, so the fit that follows writes the one report into the logger's directory.

Everything trains for real on CPU, in this process, with few steps.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

from lightning_debug import (
    AnomalyDetectionCallback,
    DebugConfig,
    GradientHealthCallback,
    MemoryProfilerCallback,
    PerformanceProfilerCallback,
)
from tests.harness.toolkit import TinyRegressor, make_trainer, read_events, read_report, regression_data

pytestmark = pytest.mark.timeout(180)

EPOCHS = 2
SAMPLES = 256


class Tunable(TinyRegressor):
    """The regressor with the attributes the finders tune (``learning_rate``, ``batch_size``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.learning_rate = 1e-3
        self.batch_size = 16

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(SAMPLES), batch_size=self.batch_size, shuffle=True)


def tune(tuner: Tuner, model: Tunable, finder: str) -> None:
    if finder == "lr_find":
        tuner.lr_find(model, num_training=40, early_stop_threshold=None)
    else:
        tuner.scale_batch_size(model, mode="power", max_trials=3, steps_per_trial=3)


def tuned_fit(root: Path, finder: str, log_zero_from_step: int | None = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    model = Tunable()
    callbacks = [AnomalyDetectionCallback(DebugConfig()), GradientHealthCallback(DebugConfig()),
                 MemoryProfilerCallback(DebugConfig()), PerformanceProfilerCallback(DebugConfig())]
    trainer = make_trainer(root, callbacks, max_steps=-1, max_epochs=EPOCHS, log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tune(Tuner(trainer), model, finder)
        model.log_zero_from_step = log_zero_from_step  # planted after tuning: the finders see a healthy model
        trainer.fit(model)
    return trainer


@pytest.mark.parametrize("finder", ["lr_find", "scale_batch_size"])
def test_a_tuned_fit_has_one_report_in_the_loggers_directory(tmp_path: Path, finder: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    trainer = tuned_fit(tmp_path, finder)
    lines = capsys.readouterr().out.splitlines()
    steps = trainer.global_step
    assert steps == EPOCHS * -(-SAMPLES // trainer.lightning_module.batch_size)
    outputs = Path(trainer.log_dir) / "debug_outputs"
    assert [path.name for path in outputs.iterdir() if path.is_dir()] == []  # no second run's directory
    report = read_report(outputs)
    assert report["status"] == "finished" and report["last_step"] == steps
    assert [f for f in report["findings"] if f["severity"] in ("warning", "error", "critical")] == []
    summaries = [line for line in lines if line.startswith("lightning-debug: run finished")]
    assert len(summaries) == 1 and f"at step {steps}," in summaries[0]


def test_a_bug_planted_after_tuning_is_named(tmp_path: Path) -> None:
    trainer = tuned_fit(tmp_path, "lr_find", log_zero_from_step=5)
    outputs = Path(trainer.log_dir) / "debug_outputs"
    losses = [event for event in read_events(outputs) if event["kind"] == "nonfinite_loss"]
    assert losses and losses[0]["step"] == 5
    assert read_report(outputs)["status"] == "finished"
