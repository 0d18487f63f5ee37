"""A checkpoint taken while a suspicion is held: the resumed run reports it as the uninterrupted one does.

Each kind with a confirmation policy is planted so that its suspicion is held, not yet confirmed, when
the checkpoint is written (at the end of an epoch, so the resumed run sees the same batches): the verdict
engine's held suspicions travel in the monitor's state, so the resumed run confirms them at the same step,
labelled where they began. Before the engine, a ``learning_stalled`` streak and a held ``update_ratio_high``
step were lost at a resume (the stall was named two check steps late, the update ratio not at all), and so
were a held run of slow steps and a suspected memory growth.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_debug import (
    AnomalyDetectionCallback,
    DebugConfig,
    GradientHealthCallback,
    MemoryProfilerCallback,
    PerformanceProfilerCallback,
)
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report, regression_data

STEPS = 20
CHECKPOINT_STEP = 12
CRASH_STEP = 14
CONFIG = DebugConfig(gradient_checking_frequency=1, log_weights=True, save_plots=False, print_summary=False)


class SimulatedCrash(RuntimeError):
    pass


class Stalls(TinyRegressor):
    """Every learning rate is 0 from step 11 (a LambdaLR that reaches 0 early; held at step 11, confirmed on the
    next check step) and the first layer's gradient fades by 1e-12 from step 10 (its neighbour stays healthy; held at
    steps 10 and 11): both suspicions are held at the checkpoint."""

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
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 11 else 0.0)
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


class Symmetric(Leaps):
    """The first two layers initialized to one constant: the first layer's units are copies from step 0 (the second's
    meet the random head and part). Read at steps 0 and 100: held at the step-48 checkpoint, confirmed at 100 and
    labelled at 0, if the resumed run reads at 100 as the uninterrupted one does."""

    steps = 110

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__(crash_at_step)
        for layer in (self.inp, self.hidden):
            torch.nn.init.constant_(layer.weight, 0.1)
            torch.nn.init.zeros_(layer.bias)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return Stalls.training_step(self, batch, batch_idx)


def gradient_callbacks() -> list[pl.Callback]:
    return [GradientHealthCallback(CONFIG)]


def fit(root: Path, model: pl.LightningModule, saver: ModelCheckpoint | None = None, *, steps: int = STEPS,
        callbacks: Callable[[], list[pl.Callback]] = gradient_callbacks, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(root, callbacks() + ([saver] if saver else []), max_steps=steps,
                           enable_checkpointing=saver is not None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, **kwargs)
    return trainer


def interrupted_and_resumed(root: Path, planted: Callable[..., pl.LightningModule], *,
                            checkpoint_step: int = CHECKPOINT_STEP, crash_step: int = CRASH_STEP,
                            **options: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    uninterrupted = fit(root / "uninterrupted", planted(), **options)
    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=checkpoint_step, save_top_k=-1)
    with pytest.raises(SimulatedCrash):
        fit(root / "interrupted", planted(crash_at_step=crash_step), saver, **options)
    checkpoint = next((root / "checkpoints").glob(f"*step={checkpoint_step}.ckpt"))
    gc.collect()
    resumed = fit(root / "resumed", planted(), ckpt_path=str(checkpoint), **options)
    state = torch.load(checkpoint, weights_only=False)["callbacks"]
    parts = [part for value in state.values() if isinstance(value, dict)
             for part in (value, *value.get("companions", {}).values())]  # a callback's monitor and its companions'
    held = [entry["first"]["kind"] for part in parts for entry in part.get("verdicts", {}).get("held", [])]
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
    runs = interrupted_and_resumed(tmp_path, planted, steps=getattr(planted, "steps", STEPS))
    assert held <= set(runs["held"]), f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    for kind, step in expected.items():
        assert uninterrupted[kind][0] == step, (kind, uninterrupted)
        assert resumed[kind] == uninterrupted[kind], (kind, resumed, uninterrupted)
    resumed_starts = [start for start in starts(runs["resumed"]) if start[0] in expected]
    assert resumed_starts == [start for start in starts(runs["uninterrupted"]) if start[0] in expected]


def test_units_held_as_copies_at_the_checkpoint_are_read_where_the_uninterrupted_run_reads_them(
        tmp_path: Path) -> None:
    runs = interrupted_and_resumed(tmp_path, Symmetric, steps=Symmetric.steps, checkpoint_step=48, crash_step=55)
    assert "symmetric_units" in runs["held"], f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    assert uninterrupted["symmetric_units"][0] == 0 and resumed["symmetric_units"] == uninterrupted["symmetric_units"]
    named = [e for e in read_events(debug_dir(runs["resumed"])) if e["kind"] == "symmetric_units"]
    assert named[0]["details"]["parameters"] == ["inp.weight"] and "at step 100" in named[0]["message"]


# --- the loss: a spike the next check settles ------------------------------------------------------------------

class LossJumps(Leaps):
    """The loss of step 11 (the last before the step-12 checkpoint) is 1e4 times its value: a suspected spike held at
    the checkpoint. ``blows_up``: its gradient too, so the weights blow up and the next check's loss stays far above
    (``loss_spike``); otherwise only the value (one batch far from the others): the next loss is back near its
    level (``loss_outlier``). Either is labelled at step 11, where the loss jumped."""

    blows_up = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = Stalls.training_step(self, batch, batch_idx)
        if self.trainer.global_step != 11:
            return loss
        return loss * 1e4 if self.blows_up else loss + (loss * (1e4 - 1)).detach()


class OneBatchJumps(LossJumps):
    blows_up = False


def anomaly_callbacks() -> list[pl.Callback]:
    return [AnomalyDetectionCallback(DebugConfig(save_plots=False, print_summary=False))]


@pytest.mark.parametrize("planted, kind", [(LossJumps, "loss_spike"), (OneBatchJumps, "loss_outlier")])
def test_a_loss_spike_held_at_the_checkpoint_is_reported_as_without_the_interruption(
        tmp_path: Path, planted: type[LossJumps], kind: str) -> None:
    """Before the loss kinds were on the verdict engine the suspected spike was checkpointed but not the step it was
    suspected at: the resumed run labelled it at the check that settled it (step 12), with that step in its
    message."""
    runs = interrupted_and_resumed(tmp_path, planted, callbacks=anomaly_callbacks)
    assert "loss_spike" in runs["held"], f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    assert uninterrupted[kind][0] == 11, uninterrupted
    assert resumed[kind] == uninterrupted[kind], (resumed, uninterrupted)
    events = [[(event["step"], event["message"]) for event in read_events(debug_dir(run)) if event["kind"] == kind]
              for run in (runs["uninterrupted"], runs["resumed"])]
    assert events[1] == events[0] and "at step 11" in events[0][0][1], events


# --- process measurements: a run of slow steps, a memory growth ------------------------------------------------

TIMED_STEPS, TIMED_CHECKPOINT, TIMED_CRASH = 60, 48, 50
STALLED = (45, 46, 47)
TIMED_CONFIG = DebugConfig(performance_profiling_frequency=1, memory_profiling_frequency=1, save_plots=False,
                           print_summary=False)


class SlowAndLeaking(TinyRegressor):
    """``training_step`` sleeps 0.12 s on steps 45-47 (slow steps in a row: a burst or a new level, held at the
    step-48 checkpoint; step 48 is back under the threshold of before, so they were a burst, labelled at 47) and
    keeps a 1 MB tensor with its graph from every step in a cache keyed by step (a leak: growth is seen first at the
    memory reading of step 42, held at the checkpoint, and confirmed at step 50).

    Step times and memory are this process's measurements: the cache is shared by the interrupted and the resumed
    model (a notebook that resumes in place keeps it; keyed by step, the resumed steps overwrite what the
    interrupted run kept after the checkpoint), so the resumed run measures what the uninterrupted one did.
    """

    def __init__(self, cache: dict[int, torch.Tensor], crash_at_step: int | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.crash_at_step = crash_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {step}")
        if step in STALLED:
            time.sleep(0.12)
        self.cache[step] = self.inp.weight.sum() * torch.ones(256, 1024)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=16 * TIMED_CHECKPOINT), batch_size=16, shuffle=False)


def timed_callbacks() -> list[pl.Callback]:
    return [PerformanceProfilerCallback(TIMED_CONFIG), MemoryProfilerCallback(TIMED_CONFIG)]


def test_a_held_run_of_slow_steps_and_a_suspected_memory_growth_are_reported_as_without_the_interruption(
        tmp_path: Path) -> None:
    """What must hold, and holds exactly here: the kind, the step each is labelled with, the steps it was recorded
    at and its episodes. The details may differ: the resumed process times its steps afresh (the history of step
    times is not checkpointed, a held run is decided by the threshold of before), and the census the growth was
    suspected with stays in the process before, so the resumed run explains it from one taken at its first check
    (``census_steps`` [48, 50] instead of [42, 50])."""
    uninterrupted_cache: dict[int, torch.Tensor] = {}
    resumed_cache: dict[int, torch.Tensor] = {}
    models = iter([lambda **kwargs: SlowAndLeaking(uninterrupted_cache, **kwargs)]
                  + [lambda **kwargs: SlowAndLeaking(resumed_cache, **kwargs)] * 2)

    def planted(**kwargs: Any) -> pl.LightningModule:
        return next(models)(**kwargs)

    runs = interrupted_and_resumed(tmp_path, planted, checkpoint_step=TIMED_CHECKPOINT, crash_step=TIMED_CRASH,
                                   steps=TIMED_STEPS, callbacks=timed_callbacks)
    assert {"slow_step", "memory_growth"} <= set(runs["held"]), f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    assert uninterrupted["slow_step"][0] == STALLED[-1] and uninterrupted["memory_growth"][0] == TIMED_CRASH, \
        uninterrupted
    for kind in ("slow_step", "memory_growth"):
        assert resumed[kind] == uninterrupted[kind], (kind, resumed, uninterrupted)
    planted_kinds = ("slow_step", "memory_growth")
    assert [start for start in starts(runs["resumed"]) if start[0] in planted_kinds] == \
        [start for start in starts(runs["uninterrupted"]) if start[0] in planted_kinds]
    burst = [event for event in read_events(debug_dir(runs["resumed"]))
             if event["kind"] == "slow_step" and event.get("episode") == "start"]
    assert burst[0]["severity"] == "warning" and burst[0]["details"]["slow_steps"] == len(STALLED), burst


# --- what the activation monitor judges every hundred steps: a loss normalised over the batch ------------------

class BatchSoftmax(pl.LightningModule):
    """``nll_loss(log_softmax(logits, dim=0))`` on four separable classes: suspected at the first judgement (step 0),
    held at the step-50 checkpoint, confirmed at the next judgement, step 100, with or without the interruption."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        self.crash_at_step = crash_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        x, y = batch
        return torch.nn.functional.nll_loss(torch.log_softmax(self(x), dim=0), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    batches = 50

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 4, (32 * self.batches,), generator=g)
        x = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(len(labels), 16, generator=g)
        return DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=32, shuffle=False)


class Broadcast(BatchSoftmax):
    """A one-value output scored with ``mse_loss`` against an (N,) target: every output fitted to the batch's mean
    target. Suspected at step 0 with that step's mean (which travels in the checkpoint), confirmed at step 100, whose
    mean differs (an epoch of 40 batches: step 100 is not step 0's batch again)."""

    batches = 40

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__(crash_at_step)
        self.head = torch.nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y.float())


class SigmoidTwice(BatchSoftmax):
    """A sigmoid as the last layer and ``binary_cross_entropy_with_logits``: suspected at step 0, confirmed at 100."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__(crash_at_step)
        self.out = torch.nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(super().forward(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self(x), torch.nn.functional.one_hot(y, 4).float())


class SortedLabels(BatchSoftmax):
    """``cross_entropy`` on data in label order (320 samples of each class), not shuffled: the batch at step 0 is all
    class 0 (the label travels in the checkpoint), the batch at step 100 (the 21st of its epoch) all class 2."""

    batches = 40

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        labels = torch.arange(4).repeat_interleave(8 * self.batches)
        x = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(len(labels), 16, generator=g)
        return DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=32, shuffle=False)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("planted, kind, cause", [(BatchSoftmax, "learning_stalled", "softmax_over_batch"),
                                                  (Broadcast, "learning_stalled", "shared_target"),
                                                  (SigmoidTwice, "learning_stalled", "probabilities_into_sigmoid"),
                                                  (SortedLabels, "single_class_batches", None)])
def test_a_suspicion_of_the_models_output_held_at_the_checkpoint_is_reported_as_without_the_interruption(
        tmp_path: Path, planted: type[BatchSoftmax], kind: str, cause: str | None) -> None:
    """The first measured step after the resume keeps the hundred-step spacing of the run before it: otherwise the
    resumed run measured at its first check step (51) and judged 100 steps after it (151). Checkpointed at the end of
    the first epoch."""
    runs = interrupted_and_resumed(tmp_path, planted, checkpoint_step=planted.batches, crash_step=planted.batches + 10,
                                   steps=110)
    assert kind in runs["held"], f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    assert uninterrupted[kind][0] == 100, uninterrupted
    assert resumed == uninterrupted
    events = [[(e["step"], e["details"].get("cause"), e["details"].get("since_step"), e.get("episode"))
               for e in read_events(debug_dir(run)) if e["kind"] == kind]
              for run in (runs["uninterrupted"], runs["resumed"])]
    assert events[1] == events[0] == [(100, cause, 0, "start"), (109, None, None, "end")], events


class SortedLabelsEpoch100(SortedLabels):
    """The labels in order in an epoch of exactly 100 batches: steps 0 and 100 see the same batch of class 0, so the
    judgement due at 100 moves to 150 (class 2)."""

    batches = 100


def test_a_judgement_moved_to_another_batch_is_taken_where_it_was_due_after_a_resume(tmp_path: Path) -> None:
    """Checkpointed at step 120, after the judgement due at 100 was moved to 150 and before it was taken: the resumed
    run takes it at 150 and names the sorted labels there, as the uninterrupted run does."""
    runs = interrupted_and_resumed(tmp_path, SortedLabelsEpoch100, checkpoint_step=120, crash_step=130, steps=160)
    assert "single_class_batches" in runs["held"], f"the checkpoint holds {runs['held']}"
    uninterrupted, resumed = findings(runs["uninterrupted"]), findings(runs["resumed"])
    assert uninterrupted["single_class_batches"][0] == 150, uninterrupted
    assert resumed == uninterrupted
