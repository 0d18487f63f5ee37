"""Stalls that recur (issue 25): a blocking call every k-th step is a ``slow_step`` warning naming the
period, the share of steps and of the time it costs and what Lightning ran in those steps; a stall at
every epoch's first batch names the DataLoader's workers. Real Trainer runs on CPU."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback, PerformanceProfilerCallback
from tests.harness.toolkit import (TinyRegressor, debug_dir, fit_seeded, make_trainer, read_events, read_scalars,
                                   regression_data)

pytestmark = pytest.mark.timeout(180)


class SleepsEveryKthStep(TinyRegressor):
    """``training_step`` sleeps on every ``period``-th optimizer step: a synchronous save or flush in user code."""

    def __init__(self, period: int, seconds: float = 0.2) -> None:
        super().__init__()
        self.period, self.seconds = period, seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step % self.period == 0:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


class SlowCheckpoint(TinyRegressor):
    """Saving a checkpoint blocks for 0.2 s (a synchronous write to slow storage)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        time.sleep(0.2)


def slow_worker_setup(worker_id: int) -> None:
    """A worker's setup that takes 0.4 s (opening files, loading an index): paid again whenever workers start. Long
    enough that a busy machine's delay in starting the worker processes (0.1-0.2 s under a 4x load of 2 cores) leaves
    the recurrences at one cost: at 0.15 s one run in four under that load went unnamed."""
    time.sleep(0.4)


class WorkersEveryEpoch(TinyRegressor):
    """Two DataLoader workers with a slow setup, 16 batches an epoch."""

    def __init__(self, persistent_workers: bool) -> None:
        super().__init__()
        self.persistent_workers = persistent_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16, shuffle=True, num_workers=2,
                          persistent_workers=self.persistent_workers, worker_init_fn=slow_worker_setup)


fit = fit_seeded


def slow_warnings(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step" and e["severity"] == "warning"
            and e.get("episode") == "start"]


def every_check_every_step() -> list[pl.Callback]:
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, performance_profiling_frequency=1)
    return [AnomalyDetectionCallback(config), GradientHealthCallback(config), PerformanceProfilerCallback(config)]


def test_a_sleep_every_5th_step_is_a_slow_step_warning_naming_the_period(tmp_path: Path) -> None:
    model = SleepsEveryKthStep(period=5)
    trainer = fit(tmp_path, model, every_check_every_step(), 30)
    found = slow_warnings(trainer)
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    first = found[0]
    details = first["details"]
    # step 0 is the step the activation verdicts hook (one forward per 100 steps), which the profiler does not time
    assert first["step"] % 5 == 0 and first["step"] <= 25, first
    assert details["period"] == 5 and details["phase"] == "forward"
    assert details["step_ms"] > 20 * details["median_step_ms"], "the plant: a stall far above the median"
    assert 0.1 < details["fraction"] <= 0.25, details
    assert "recurs every 5th step" in first["message"] and "of steps" in first["message"]
    assert "No validation or checkpoint saving ran" in first["message"]
    assert len(found) == 1, "one episode for one periodic stall"


def test_a_slow_checkpoint_every_5_steps_is_named_with_the_hook_that_ran(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    config = DebugConfig(performance_profiling_frequency=1)
    trainer = fit(tmp_path, SlowCheckpoint(), [PerformanceProfilerCallback(config), checkpoints], 30,
                  enable_checkpointing=True)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) >= 5, "the plant: a checkpoint every 5 steps"
    found = slow_warnings(trainer)
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    details = found[0]["details"]
    assert details["period"] == 5 and details["phase"] == "data", details
    assert details["hooks"]["checkpoint saving"] == details["outlier_steps"], details
    assert "checkpoint saving (steps" in found[0]["message"]


def test_a_checkpoint_saved_on_every_timed_step_is_no_data_loader_bottleneck(tmp_path: Path) -> None:
    """ModelCheckpoint every 10 steps at the profiler's default frequency (every 10th step timed): each timed
    step's data wait holds a blocking save, which is not the loader's, so no advice about workers."""
    class SavesIn20ms(TinyRegressor):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            time.sleep(0.02)

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    trainer = fit(tmp_path, SavesIn20ms(), [PerformanceProfilerCallback(), checkpoints], 90, enable_checkpointing=True)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 9, "the plant: a save every 10 steps"
    data_ms = dict(read_scalars(trainer.logger.log_dir)["debug/perf/data_ms"])
    assert all(data_ms[step] >= 20 for step in range(10, 80, 10)), f"the saves are in the data wait: {data_ms}"
    events = read_events(debug_dir(trainer))
    assert not [e for e in events if e["kind"] == "dataloader_bottleneck"], events


def test_a_slow_checkpoint_after_validation_every_5_steps_names_both(tmp_path: Path) -> None:
    """Validation every 5 batches and ModelCheckpoint saving when it ends (its default): the validation's own time
    is left out of the steps, the blocking save is not, and both are named."""
    class Validated(SlowCheckpoint):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", super().training_step(batch, batch_idx))

        def val_dataloader(self) -> Any:
            return super().train_dataloader()

    config = DebugConfig(performance_profiling_frequency=1)
    trainer = fit(tmp_path, Validated(), [PerformanceProfilerCallback(config),
                                          ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)], 30,
                  enable_checkpointing=True, val_check_interval=5, limit_val_batches=2, num_sanity_val_steps=0)
    found = slow_warnings(trainer)
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    details = found[0]["details"]
    # 16 batches an epoch, validation every 5: steps 5, 10, 15, then 21, 26 (no fixed period; a hiccup of a loaded
    # machine at step 20 can make the first four look periodic, which is not what this test is about)
    assert details["recurring"] and details["outliers"] >= 4, details
    for hook in ("validation", "checkpoint saving"):
        assert {5, 10, 15} <= set(details["hooks"][hook]) <= set(details["outlier_steps"]), details
    assert "validation (steps 5, 10, 15" in found[0]["message"]


def test_at_the_defaults_a_stall_is_seen_through_the_timed_steps_with_the_advice_to_time_every_step(
        tmp_path: Path) -> None:
    """Only every 10th step is timed by default: a stall every 15th step shows on every 30th (0, 30, 60...);
    a stall whose period divides 10 would be on every timed step or on none (the docs say so)."""
    trainer = fit(tmp_path, SleepsEveryKthStep(period=15), [PerformanceProfilerCallback()], 160)
    found = slow_warnings(trainer)
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    details, step = found[0]["details"], found[0]["step"]
    # 120 on a quiet machine; one timed step slowed by other work (another test worker on the same two cores)
    # between the stalls puts it off by one recurrence, which is the rule's holding, not a miss
    assert step in (120, 150) and details["period"] == 30, details
    assert details["outlier_steps"][-3:] == [step - 60, step - 30, step], details
    assert "performance_profiling_frequency=1" in found[0]["message"]


class WritesEveryKthStep(SleepsEveryKthStep):
    """The same blocking call every ``period``-th step, or (``background=True``, the fix) handed to a thread."""

    def __init__(self, period: int, seconds: float, background: bool) -> None:
        super().__init__(period, seconds)
        self.background = background
        self.writer = concurrent.futures.ThreadPoolExecutor(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if step and step % self.period == 0:
            if self.background:
                self.writer.submit(time.sleep, self.seconds)
            else:
                time.sleep(self.seconds)
        return TinyRegressor.training_step(self, batch, batch_idx)


@pytest.mark.parametrize("background", [False, True])
def test_a_30ms_write_every_20th_step_of_a_fast_model_is_a_rhythm_under_the_floor(tmp_path: Path,
                                                                                   background: bool) -> None:
    """At the defaults (every 10th step timed) the write lands on every other timed step: half the history, so the
    median is its own, and 30 ms is under MIN_SLOW_EXCESS_MS. Six recurrences at one period and one cost name it;
    the same write on a thread (the fix) leaves the run quiet."""
    model = WritesEveryKthStep(period=20, seconds=0.03, background=background)
    trainer = fit(tmp_path, model, [PerformanceProfilerCallback()], 160)
    model.writer.shutdown(wait=True)
    found = slow_warnings(trainer)
    if background:
        assert found == []
        return
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    details = found[0]["details"]
    step = found[0]["step"]  # 120, or 140 when a timed step between the first six was delayed by the machine
    assert step in (120, 140) and details["period"] == 20 and details["phase"] == "forward", details
    assert details["outlier_steps"] == list(range(step - 100, step + 1, 20)) and details["time_share"] > 0.5, details


def test_a_healthy_run_timed_every_step_has_no_slow_step_warning(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyRegressor(), every_check_every_step(), 60)
    assert slow_warnings(trainer) == []


def test_workers_restarting_every_epoch_are_named_with_persistent_workers(tmp_path: Path) -> None:
    """persistent_workers=False (the default): the first batch of every epoch waits for the workers' setup. The last
    epoch's validation and checkpoint ran before the epoch started, outside the step's time: not blamed. Eight epochs:
    the rhythm needs six recurrences at one cost; with six epochs, exactly enough, it went unnamed in three xdist
    runs (one a fresh-clone CI) while passing alone, likely a worker start slowed by the test beside it."""
    config = DebugConfig(performance_profiling_frequency=1)
    trainer = fit(tmp_path, WorkersEveryEpoch(persistent_workers=False), [PerformanceProfilerCallback(config)], 128,
                  enable_checkpointing=True, limit_val_batches=2, num_sanity_val_steps=0)
    found = slow_warnings(trainer)
    assert found, [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step"]
    first, details = found[0], found[0]["details"]
    assert first["step"] % 16 == 0 and first["batch"] == 0 and details["period"] == 16, first
    assert details["phase"] == "data" and details["epoch_start"] and details["time_share"] > 0.5, details
    assert "starts its 2 worker process(es) again" in first["message"]
    assert "persistent_workers=True keeps them" in first["message"]
    assert "validation" not in first["message"] and "checkpoint saving" not in first["message"], first["message"]


def test_one_batch_an_epoch_that_waits_for_its_workers_leads_with_persistent_workers(tmp_path: Path) -> None:
    """limit_train_batches=1: every step is an epoch's first batch and waits for the workers' setup. The loader is
    the bottleneck, and what fixes it is keeping the workers, not more of them (which the advice used to lead with)."""
    config = DebugConfig(performance_profiling_frequency=1)
    trainer = fit(tmp_path, WorkersEveryEpoch(persistent_workers=False), [PerformanceProfilerCallback(config)], 8,
                  max_epochs=8, limit_train_batches=1, limit_val_batches=0)
    found = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "dataloader_bottleneck"]
    assert found, read_events(debug_dir(trainer))
    advice = found[0]["details"]["advice"]
    assert advice[0].startswith("The steps that wait are the first batch of an epoch") and "persistent_workers=True" \
        in advice[0] and "cannot keep up" not in found[0]["message"], found[0]["message"]
    assert found[0]["details"]["epoch_starts"] == found[0]["details"]["steps_above_share"]


def test_persistent_workers_leave_epoch_boundaries_quiet(tmp_path: Path) -> None:
    config = DebugConfig(performance_profiling_frequency=1)
    trainer = fit(tmp_path, WorkersEveryEpoch(persistent_workers=True), [PerformanceProfilerCallback(config)], 96)
    assert slow_warnings(trainer) == []


def test_under_accelerate_the_same_rhythm_is_named(tmp_path: Path) -> None:
    """The rhythm is the framework-free slow-step rule's: a 30 ms blocking call every 20th step of an Accelerate loop,
    timed every 10th step at the defaults, is named from its sixth recurrence as in a Trainer."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness.toolkit import fresh_accelerate, run_dir

    with fresh_accelerate():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
        model, steps = torch.nn.Linear(8, 1), 160
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(regression_data(), batch_size=16, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        debugger = AccelerateDebugger(accelerator, model, optimizer,
                                      DebugConfig(save_plots=False, print_summary=False), train_dataloader=loader,
                                      total_steps=steps)
        with debugger:
            while debugger.step < steps:
                for x, y in loader:
                    if debugger.step and debugger.step % 20 == 0:
                        time.sleep(0.03)
                    debugger.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y.squeeze(-1)))
                    optimizer.step()
                    optimizer.zero_grad()
                    if debugger.step >= steps:
                        break
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    found = [e for e in events
             if e["kind"] == "slow_step" and e["severity"] == "warning" and e.get("episode") == "start"]
    assert found, [(e["step"], e["kind"], e["severity"]) for e in events]
    assert found[0]["step"] in (120, 140) and found[0]["details"]["period"] == 20, found[0]["details"]
