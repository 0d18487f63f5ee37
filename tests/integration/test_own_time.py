"""The plugin never reports its own cost, and timing findings hold on a loaded machine.

A tensor census, the checks and the logging done by the plugin are left out of step timing; a
``slow_step`` is a robust, recurring outlier; a ``dataloader_bottleneck`` needs a sustained, large
data wait; the leak explanation leads with the tensors that keep a graph alive.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_debug import DebugConfig, MemoryProfilerCallback, PerformanceProfilerCallback
from lightning_debug.monitors.performance import PerformanceMonitor
from tests.harness.toolkit import console_lines, TinyRegressor, debug_dir, make_trainer, plain_run, read_events, read_report

pytestmark = pytest.mark.timeout(180)
TIMING_KINDS = {"slow_step", "dataloader_bottleneck", "straggler_rank"}
LOUD = {"warning", "error", "critical"}


class KeepsGraphs(pl.LightningModule):
    """A classifier that appends every loss to a list with its graph (the classic leak): each kept
    ``NllLossBackward0`` scalar keeps its batch's activations and targets alive."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.kept.append(loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4096, 32, generator=generator), torch.randint(0, 10, (4096,), generator=generator))
        return DataLoader(data, batch_size=32, shuffle=True)


class SleepyDataset(Dataset):
    """``__getitem__`` sleeps: slow decoding left in the training process."""

    def __init__(self, seconds: float, samples: int = 1024) -> None:
        self.seconds, self.inner = seconds, TensorDataset(torch.randn(samples, 8), torch.randn(samples, 1))

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds)
        return self.inner[index]


class SlowLoaderRegressor(TinyRegressor):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(SleepyDataset(0.005), batch_size=8)


class SlowEveryThirdStep(TinyRegressor):
    """A blocking call every third step (a synchronous checkpoint or a host round trip gone wrong)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step % 3 == 2:
            time.sleep(0.15)
        return super().training_step(batch, batch_idx)


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """Another program burning every core while the test trains (killed at the end, or after 120 s)."""
    burn = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        time.sleep(0.2)
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=10)


def timing_events(trainer: Any) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if e["kind"] in TIMING_KINDS and e.get("episode") != "end"]


def test_census_is_no_slow_step_and_the_kept_graph_leads_the_leak_explanation(tmp_path: Path) -> None:
    config = DebugConfig(memory_profiling_frequency=10, performance_profiling_frequency=1)
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(config), PerformanceProfilerCallback(config)],
                           max_steps=250)
    with console_lines("memory_growth"):
        trainer.fit(KeepsGraphs())

    events = read_events(debug_dir(trainer))
    growth = [e for e in events if e["kind"] == "memory_growth" and e.get("episode") == "start"]
    assert len(growth) == 1, [e["kind"] for e in events]
    census_steps = growth[0]["details"]["census_steps"]
    slow = [e for e in events if e["kind"] == "slow_step"]
    assert not [e for e in slow if e["step"] in census_steps or e["severity"] in LOUD], slow

    report = read_report(debug_dir(trainer))
    census_ms = report["sections"]["memory"]["cost_ms"]["census"]
    assert census_ms["count"] == 2
    plugin_ms = report["sections"]["performance"]["plugin_time_ms"]
    assert plugin_ms["max"] >= 0.9 * census_ms["max"]  # the census was inside a timed step, and left out of it

    # the explanation leads with the loss scalars that keep their graphs, not the targets those graphs saved
    details = growth[0]["details"]
    assert details["tensors"][0]["grad_fn"] == "NllLossBackward0", details["tensors"]
    assert details["tensors"][0]["shape"] == []
    explanation = growth[0]["message"].split(". ", 1)[1]
    assert explanation.startswith("~1 tensor/step with grad_fn NllLossBackward0"), explanation
    assert "loss.detach()" in explanation


def test_healthy_run_on_a_loaded_machine_has_no_timing_finding(tmp_path: Path, busy_machine: None) -> None:
    config = DebugConfig(performance_profiling_frequency=1, memory_profiling_frequency=5)
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(config), MemoryProfilerCallback(config)],
                           max_steps=80)
    trainer.fit(TinyRegressor())
    loud = [e for e in timing_events(trainer) if e["severity"] in LOUD]
    assert loud == [], [e["message"] for e in loud]
    assert not [e for e in timing_events(trainer) if e["kind"] == "dataloader_bottleneck"]


def test_slow_loader_on_a_loaded_machine_is_a_dataloader_bottleneck(tmp_path: Path, busy_machine: None) -> None:
    # Lightning's usual cadence: its logging rows (which carry the debug scalars) are written between two batches,
    # where the CPU waits of writing them on a loaded machine would come off the judged data wait at every step
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=1)], max_steps=24,
                           log_every_n_steps=50)
    trainer.fit(SlowLoaderRegressor())
    found = [e for e in timing_events(trainer) if e["kind"] == "dataloader_bottleneck"]
    assert found and found[0]["severity"] == "warning", [e["message"] for e in timing_events(trainer)]
    details = found[0]["details"]
    assert details["data_ms"] >= 35  # 8 samples x 5 ms
    assert details["steps_above_share"] >= 0.7 * details["window_check_steps"]
    assert details["num_workers"] == 0


def test_recurring_slow_step_is_a_warning_naming_its_phase(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=1)], max_steps=40)
    trainer.fit(SlowEveryThirdStep())
    slow = [e for e in timing_events(trainer) if e["kind"] == "slow_step" and e["severity"] == "warning"]
    assert slow, [e["message"] for e in timing_events(trainer)]
    details = slow[0]["details"]
    assert slow[0]["step"] % 3 == 2 and details["phase"] == "forward" and details["recurring"]
    assert details["slow_steps"] >= 3 and details["phase_ms"] >= 145
    assert "of the last" in slow[0]["message"]


def test_recurring_slow_step_on_a_loaded_machine_is_still_named(tmp_path: Path, busy_machine: None) -> None:
    """The twin of the loaded machine's quiet: a sleeping step waits for no CPU, so what the process's threads waited
    for one takes none of its 150 ms away."""
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=1)], max_steps=40)
    trainer.fit(SlowEveryThirdStep())
    slow = [e for e in timing_events(trainer) if e["kind"] == "slow_step" and e["severity"] == "warning"]
    assert slow, [e["message"] for e in timing_events(trainer)]
    assert slow[0]["step"] % 3 == 2 and slow[0]["details"]["phase"] == "forward"


def test_rank_zero_logging_is_no_straggler(tmp_path: Path) -> None:
    """Simulated two ranks: rank 0 spends 3 ms more between steps every step (logging, writing)."""

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        other = local.clone()
        other[2] = max(float(local[2]) - 3.0, 0.0)  # rank 1 waits 3 ms less for data
        return torch.stack([local, other])

    def slow_data() -> None:
        time.sleep(0.003)

    monitor = PerformanceMonitor(DebugConfig(performance_profiling_frequency=1), "loop")
    run = plain_run([monitor], tmp_path, world_size=2, all_gather=all_gather)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.start(0)
    for step in range(20):
        slow_data()
        batch = torch.randn(32, 64)
        run.batch_start(step, batch)
        loss = model(batch).pow(2).mean()
        run.before_backward(step, loss)
        loss.backward()
        run.before_optimizer_step(step, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        run.after_optimizer_step(step + 1)
        run.batch_end(batch)
    run.finish("finished", 20)
    assert [e for e in read_events(tmp_path) if e["kind"] == "straggler_rank"] == []


def test_phase_timer_leaves_out_the_plugin_time_and_judges_without_cpu_waits() -> None:
    """Framework-free: 30 ms of plugin work inside backward and 20 ms of CPU wait in forward."""
    from lightning_debug.checks.timing import PhaseTimer, Stopwatch
    from lightning_debug.core.own_time import OwnTime

    own, waited = OwnTime(), [0.0]
    own.enabled = True
    watch = Stopwatch(None, own.total_ms, lambda: waited[0])
    timer = PhaseTimer(watch, step=3, start=watch.mark())
    timer.enter("forward")
    time.sleep(0.02)
    waited[0] += 15.0  # the scheduler gave the CPU to another program for 15 ms of those 20
    timer.enter("backward")
    own.call(time.sleep, 0.03)  # a census
    timer.enter("optimizer")
    timer.stop()
    times = timer.read()
    assert times.own_ms >= 29 and times.phases["backward"] < 10, times
    assert times.phases["forward"] >= 19 and 4 <= times.judged("forward") <= times.phases["forward"] - 14.9
    assert times.judged_step_ms == pytest.approx(times.step_ms - 15.0)
