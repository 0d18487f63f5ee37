"""A checkpoint taken while a suspicion is held: the resumed run reports it as the uninterrupted one does.

Each kind with a confirmation policy is planted so that its suspicion is held, not yet confirmed, when
the step-12 checkpoint is written: the verdict engine's held suspicions travel in the monitor's state, so
the resumed run confirms them at the same step, labelled where they began. Before the engine, a
``learning_stalled`` streak and a held ``update_ratio_high`` step were lost at a resume (the stall was
named two check steps late, the update ratio not at all).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report, regression_data

STEPS = 20
CHECKPOINT_STEP = 12
CRASH_STEP = 14
CONFIG = DebugConfig(gradient_checking_frequency=1, log_weights=True, save_plots=False, print_summary=False)


class SimulatedCrash(RuntimeError):
    pass


class Stalls(TinyRegressor):
    """Every learning rate is 0 from step 10 (a LambdaLR that reaches 0 early) and the first layer's gradient
    fades by 1e-12 from step 10 (its neighbour stays healthy): both suspicions are held at steps 10 and 11."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__()
        self.crash_at_step = crash_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.trainer.global_step >= 10:
            h = h * 1e-12 + (h * (1 - 1e-12)).detach()
        return self.head(torch.relu(self.hidden(torch.relu(h))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 10 else 0.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=16 * CHECKPOINT_STEP), batch_size=16, shuffle=False)


class Leaps(Stalls):
    """The loss is scaled by 1e5 on step 11 (its update moves the weights by far more than their norm, held
    at the checkpoint) and the loss blows up after it: ``update_ratio_high`` confirmed by the next check."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.inp(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e5 if self.trainer.global_step == 11 else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Unused(Leaps):
    """A layer no forward calls: held from step 0 (64 optimizer steps without a gradient confirm it), so held at
    the checkpoint and confirmed at step 63 of the resumed run, labelled at step 0."""

    steps = 70

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__(crash_at_step)
        self.unused = torch.nn.Linear(16, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return Stalls.training_step(self, batch, batch_idx)


def fit(root: Path, model: pl.LightningModule, saver: ModelCheckpoint | None = None, **kwargs: Any) -> pl.Trainer:
    callbacks: list[pl.Callback] = [GradientHealthCallback(CONFIG)] + ([saver] if saver else [])
    trainer = make_trainer(root, callbacks, max_steps=getattr(model, "steps", STEPS),
                           enable_checkpointing=saver is not None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, **kwargs)
    return trainer


def interrupted_and_resumed(root: Path, planted: type[Stalls]) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    uninterrupted = fit(root / "uninterrupted", planted())
    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=CHECKPOINT_STEP, save_top_k=-1)
    with pytest.raises(SimulatedCrash):
        fit(root / "interrupted", planted(crash_at_step=CRASH_STEP), saver)
    checkpoint = next((root / "checkpoints").glob(f"*step={CHECKPOINT_STEP}.ckpt"))
    resumed = fit(root / "resumed", planted(), ckpt_path=str(checkpoint))
    state = torch.load(checkpoint, weights_only=False)["callbacks"]
    held = [entry["first"]["kind"] for value in state.values() if isinstance(value, dict)
            for entry in value.get("verdicts", {}).get("held", [])]
    return {"uninterrupted": uninterrupted, "resumed": resumed, "held": held}


def findings(trainer: pl.Trainer) -> dict[str, tuple[int, int, int]]:
    return {kind: (entry["first_step"], entry["steps"], entry["episodes"])
            for kind, entry in read_report(debug_dir(trainer))["findings"].items()}


def starts(trainer: pl.Trainer) -> list[tuple[str, int]]:
    return sorted((event["kind"], event["step"]) for event in read_events(debug_dir(trainer))
                  if event.get("episode") == "start")


@pytest.mark.parametrize("planted, held, expected", [
    (Stalls, {"learning_stalled", "vanishing_grad"}, {"learning_stalled": 12, "vanishing_grad": 10}),
    (Leaps, {"update_ratio_high"}, {"update_ratio_high": 11}),
    (Unused, {"missing_grad"}, {"missing_grad": 0}),
])
def test_a_suspicion_held_at_the_checkpoint_is_reported_as_without_the_interruption(
        tmp_path: Path, planted: type[Stalls], held: set[str], expected: dict[str, int]) -> None:
    runs = interrupted_and_resumed(tmp_path, planted)
    assert held <= set(runs["held"]), f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    for kind, step in expected.items():
        assert uninterrupted[kind][0] == step, (kind, uninterrupted)
        assert resumed[kind] == uninterrupted[kind], (kind, resumed, uninterrupted)
    resumed_starts = [start for start in starts(runs["resumed"]) if start[0] in expected]
    assert resumed_starts == [start for start in starts(runs["uninterrupted"]) if start[0] in expected]
