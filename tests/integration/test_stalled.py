"""``learning_stalled`` in a real Trainer: a ``LambdaLR`` whose factor drops to 0 after step 10 of 60 (a common
scheduler bug: training silently stops learning) is named at step 10 with the scheduler, a ``StepLR`` written per
epoch but registered per step once it is a millionth of its base, and a ``ReduceLROnPlateau(mode="max")`` watching
the training loss, which cuts the lr at every patience; a cosine schedule that reaches 0 at the end of the
run, a linear warm-up from 0 and a steep decay that stays above a millionth of its base are quiet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_debug import DebugConfig, debug_callbacks
from lightning_debug.monitors.gradients.stalled import FITTED_SHARE
import pytest

from tests.harness.toolkit import Blobs, TinyRegressor, debug_dir, make_trainer, read_events, read_scalars

EVERY_STEP = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1)


class Scheduled(TinyRegressor):
    def __init__(self, schedule: str) -> None:
        super().__init__(lr=0.01)
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.schedule == "zero_after_10":
            scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 10 else 0.0)
        elif self.schedule == "step_decay_per_step":  # StepLR meant per epoch: 5x down every 5 steps
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.2)
        elif self.schedule == "steep_decay":  # 0.8 a step: 7e-6 of its base at step 53, 90% of the run
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
        elif self.schedule == "cosine_to_zero":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=60, eta_min=0.0)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 5))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def serious_kinds(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in events
            if e.get("severity") in ("warning", "error", "critical") and e.get("episode") != "end"]


def run(root: Path, schedule: str) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(root, debug_callbacks(EVERY_STEP), max_steps=60)
    trainer.fit(Scheduled(schedule))
    return read_events(debug_dir(trainer))


def test_a_scheduler_that_drops_the_learning_rate_to_zero_mid_run_is_named(tmp_path: Path) -> None:
    events = run(tmp_path, "zero_after_10")
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e.get("episode") != "end"]
    assert [e["step"] for e in stalled] == [11]  # confirmed on the second check step at lr 0
    details = stalled[0]["details"]
    assert details["since_step"] == 10 and details["schedulers"] == ["LambdaLR"] and details["total_steps"] == 60
    assert "at step 10" in stalled[0]["message"] and "LambdaLR" in stalled[0]["message"]
    assert serious_kinds(events) == [("learning_stalled", 11)]


def test_a_step_decay_registered_per_step_is_named_once_it_is_a_millionth_of_its_base(tmp_path: Path) -> None:
    events = run(tmp_path, "step_decay_per_step")
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e.get("episode") != "end"]
    assert [(e["step"], e["details"]["since_step"]) for e in stalled] == [(STEP_DECAY_CONFIRMED, STEP_DECAY_SINCE)]
    details = stalled[0]["details"]
    assert details["schedulers"] == ["StepLR"] and details["initial_lr"] == [0.01]
    assert 0 < details["learning_rates"][0] <= 1e-8
    assert "0 in effect" in stalled[0]["message"] and "per step" in stalled[0]["message"]
    assert serious_kinds(events) == [("learning_stalled", STEP_DECAY_CONFIRMED)]


STEP_DECAY_SINCE = 45
"""The first step at most 1e-6 of the base: 0.2^9 = 5.1e-7 (step 40: 0.2^8 = 2.6e-6); the second check step confirms."""
STEP_DECAY_CONFIRMED = 46


class Plateau(TinyRegressor):
    """``ReduceLROnPlateau(mode="max")`` on the logged training loss, per step: a loss that falls is "no improvement"
    at every step, so the lr is halved every 6 steps, down to 1.2e-8 (a cut under ``eps=1e-8`` is not made), 2e-7 of
    its base from step 120."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=5, factor=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "train_loss"}}


def test_a_plateau_scheduler_watching_a_loss_for_a_rise_is_named_at_the_default_frequency(tmp_path: Path) -> None:
    """Checked every 100 steps, the lr is 0 in effect at steps 200 and 300 only (360 is 90% of the run): when a stall
    needed 3 check steps in a row, this run ended in "No problems found"; it needs 2 and 1% of the run."""
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig()), max_steps=400)
    model = Plateau()
    trainer.fit(model)
    dead = next(step for step, lr in enumerate(model.lrs) if lr <= 1e-6 * 0.05)
    assert 100 < dead < 200, "the plant: the lr 0 in effect between the first and the second check step"
    events = read_events(debug_dir(trainer))
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e.get("episode") != "end"]
    assert [e["step"] for e in stalled] == [300] and stalled[0]["details"]["schedulers"] == ["ReduceLROnPlateau"]
    assert stalled[0]["details"]["since_step"] == 200 and "mode='max'" in stalled[0]["message"]
    assert serious_kinds(events) == [("learning_stalled", 300)]


class BlobsOnAPlateau(Blobs):
    """Blobs classified under ``ReduceLROnPlateau`` stepped on the training loss every step. With ``mode="min"`` the
    loss reaches 0 (the blobs are apart) and every later batch is no improvement, so the lr is halved every 6 steps
    from then on, a millionth of its base before step 200; with ``mode="max"`` the falling loss is no improvement
    from the start, and the lr dies while the loss is about 2e-3 of its first, over ten times a fit's."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode=self.mode, patience=5, factor=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "train_loss"}}


@pytest.mark.parametrize("level", ["basic", "advanced"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_plateau_scheduler_that_cuts_the_lr_once_the_training_data_is_fit_is_no_stall(tmp_path: Path, mode: str,
                                                                                        level: str) -> None:
    """A loss at most 1e-4 of its first is a fitted training set: ``mode="min"`` killing the lr then ends a run with
    nothing left to learn (named at step 300 before the fix). Its twin, ``mode="max"`` on the same model, kills the lr
    as early while the loss is far above that and is named. At ADVANCED a step at a learning rate 0 in effect that
    leaves the weights unchanged is no ``frozen_param`` (``no_update``: at step 200 with ``mode="min"``, at 300 beside
    the stall with ``mode="max"``, before the fix): the learning rate's doing, which ``learning_stalled`` judges."""
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig(level=level)), max_steps=400)
    model = BlobsOnAPlateau(mode)
    trainer.fit(model)
    dead = next(step for step, lr in enumerate(model.lrs) if lr <= 1e-6 * 0.05)
    assert dead < 200, "the plant: the lr 0 in effect by the second check step"
    events = read_events(debug_dir(trainer))
    if mode == "min":
        assert max(model.losses[100], model.losses[200]) <= FITTED_SHARE * model.losses[0], "the plant: the data fit"
        assert serious_kinds(events) == []
    else:
        losses = [model.losses[step] for step in (200, 300)]
        assert min(losses) > 10 * FITTED_SHARE * model.losses[0], "the twin: the lr died above a fit"
        assert serious_kinds(events) == [("learning_stalled", 300)]


class AdamCosineToZero(TinyRegressor):
    """Adam with a cosine schedule to ``eta_min=0`` over the run: at its tail the updates are about a millionth of
    the weights, and the head's bias, whose update rounds away, is left exactly unchanged on some steps."""

    def __init__(self) -> None:
        super().__init__(lr=1e-3, optimizer="adam")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=300, eta_min=0.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_updates_that_round_away_at_the_tail_of_a_schedule_are_no_frozen_parameter(tmp_path: Path) -> None:
    """At ADVANCED every step is checked for parameters the optimizer step left unchanged (``no_update``); before
    the fix this run had ``frozen_param`` for ``head.bias`` at step 298 of 300."""
    config = DebugConfig(level="advanced", anomaly_check_frequency=1, gradient_checking_frequency=1,
                         memory_profiling_frequency=1, performance_profiling_frequency=1, follow_log_cadence=False)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=300)
    trainer.fit(AdamCosineToZero())
    ratios = dict(read_scalars(trainer.logger.log_dir)["debug/weight/update_ratio_global"])
    assert ratios[298] < 1e-5 < ratios[10], "the plant: updates at the precision of float32 weights at the tail"
    assert serious_kinds(read_events(debug_dir(trainer))) == []


class BlobsSGD(Blobs):
    def __init__(self, lr: float, optimizer: str = "sgd") -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD)(self.parameters(), lr=self.lr)


@pytest.mark.parametrize(("optimizer", "lr", "clip", "algorithm"), [
    ("sgd", 0.05, 1e-4, "norm"), ("sgd", 0.05, 1e-6, "value"), ("sgd", 1e-6, None, "norm"), ("sgd", 0.05, 1.0, "norm"),
    ("adam", 1e-7, 1e-2, "norm")])
def test_clipping_that_cuts_every_step_is_named_not_the_learning_rate(tmp_path: Path, optimizer: str, lr: float,
                                                                       clip: float | None, algorithm: str) -> None:
    """``Trainer(gradient_clip_val=1e-4)`` (or 1e-6 by value) under SGD at 0.05: Lightning clips after the checks read
    the gradients, the weights move 1e-7 of their size a step and the advice was to raise the learning rate. The
    twins: a learning rate of 1e-6 without clipping is named with that advice, clipping at 1.0 is quiet, and Adam at
    1e-7, which divides by the gradients' scale, is told about its learning rate even clipped at 1e-2 (300x)."""
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig()), max_steps=400, gradient_clip_val=clip,
                           gradient_clip_algorithm=algorithm)
    trainer.fit(BlobsSGD(lr, optimizer))
    events = read_events(debug_dir(trainer))
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e.get("episode") != "end"
               and e["details"].get("cause") == "negligible_updates"]
    if clip == 1.0:
        assert serious_kinds(events) == []
        return
    assert [e["step"] for e in stalled] == [300], serious_kinds(events)
    message, details = stalled[0]["message"], stalled[0]["details"]
    if clip is None or optimizer == "adam":
        assert "clip_cut" not in details and "learning rate is far too small" in message
    else:
        assert details["clip_cut"] >= 100 and f"gradient_clip_val={clip:g}" in message
        assert "learning rate is far too small" not in message
