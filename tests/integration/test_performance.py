"""PerformanceProfilerCallback / PerformanceMonitor: phase times, stalls found, torch.profiler window."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, PerformanceProfilerCallback
from lightning_debug.checks.timing import Stopwatch
from lightning_debug.monitors.performance import PerformanceMonitor
from lightning_debug.run import Run
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, plain_run, read_events, read_report, read_scalars

PHASE_TAGS = ("step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms")


class SleepyDataset(Dataset):
    """A dataset whose ``__getitem__`` sleeps: the slow decoding a user forgot to move to workers."""

    def __init__(self, seconds_per_sample: float, samples: int = 256, features: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(samples, features, generator=generator)
        self.targets = torch.randn(samples, 1, generator=generator)
        self.seconds_per_sample = seconds_per_sample

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds_per_sample)
        return self.inputs[index], self.targets[index]


class SleepyLoaderRegressor(TinyRegressor):
    def __init__(self, seconds_per_sample: float, batch_size: int) -> None:
        super().__init__()
        self.seconds_per_sample = seconds_per_sample
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SleepyDataset(self.seconds_per_sample), batch_size=self.batch_size, num_workers=0)


class SleepsOnceRegressor(TinyRegressor):
    """``training_step`` sleeps once, at one optimizer step (a stray blocking call in user code)."""

    def __init__(self, sleep_at_step: int, seconds: float) -> None:
        super().__init__()
        self.sleep_at_step = sleep_at_step
        self.seconds = seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.sleep_at_step:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


def perf_scalars(trainer: Any) -> dict[str, list[tuple[int, float]]]:
    scalars = read_scalars(trainer.logger.log_dir)
    return {tag.removeprefix("debug/perf/"): values for tag, values in scalars.items() if tag.startswith("debug/perf/")}


def test_phase_scalars_logged_at_check_steps_only(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=5)], max_steps=20)
    trainer.fit(TinyRegressor())

    scalars = perf_scalars(trainer)
    for tag in PHASE_TAGS + ("samples_per_sec",):
        assert [step for step, _ in scalars[tag]] == [0, 5, 10, 15], tag
        assert all(value > 0 for _, value in scalars[tag]), tag
    for index in range(4):
        step_ms = scalars["step_ms"][index][1]
        parts = sum(scalars[tag][index][1] for tag in PHASE_TAGS[1:])
        assert step_ms == pytest.approx(parts, rel=1e-3)
        assert scalars["samples_per_sec"][index][1] == pytest.approx(16 * 1000.0 / step_ms, rel=1e-3)

    report = read_report(debug_dir(trainer))
    step_stats = report["stats"]["step_time_ms"]
    assert step_stats["count"] == 4
    assert step_stats["min"] <= step_stats["median"] <= step_stats["p90"] <= step_stats["max"]
    assert report["stats"]["data_time_ms"]["count"] == 4
    report_md = (debug_dir(trainer) / "report.md").read_text()
    assert "## Step time" in report_md and "| forward |" in report_md


def test_sleeping_dataset_is_a_dataloader_bottleneck(tmp_path: Path) -> None:
    sleep_per_sample, batch_size = 0.020, 2
    planted_ms = 1000 * sleep_per_sample * batch_size
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=1)], max_steps=8)
    trainer.fit(SleepyLoaderRegressor(sleep_per_sample, batch_size))

    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "dataloader_bottleneck"]
    assert events, read_events(debug_dir(trainer))
    details = events[0]["details"]
    assert 0.9 * planted_ms <= details["data_ms"] <= planted_ms + 30, details
    assert details["share"] > 0.5
    assert details["num_workers"] == 0
    assert details["pin_memory"] is False and details["persistent_workers"] is False
    assert any("num_workers" in line for line in details["advice"])

    data_ms = [value for _, value in perf_scalars(trainer)["data_ms"]]
    assert 0.9 * planted_ms <= statistics.median(data_ms) <= planted_ms + 30


def test_a_logger_that_takes_its_time_writing_each_row_is_no_data_wait(tmp_path: Path) -> None:
    """Lightning writes its logging row between one batch's end and the next one's start, where the data wait is
    timed. A logger that sends each row over the network (here 20 ms a row) with ``log_every_n_steps=1`` read as a
    data wait of 20 ms on every step: a ``dataloader_bottleneck`` naming ``num_workers`` on a healthy model."""
    from lightning.pytorch.loggers import TensorBoardLogger

    class RemoteLogger(TensorBoardLogger):
        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            time.sleep(0.020)
            super().log_metrics(metrics, step)

    logger = RemoteLogger(str(tmp_path), name="tb")
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1)
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(config)], max_steps=24, logger=logger)
    trainer.fit(TinyRegressor())
    assert "log_metrics" not in vars(logger), "the logger is given back as it was"
    data_ms = [value for _, value in perf_scalars(trainer)["data_ms"]]
    assert statistics.median(data_ms) < 10, data_ms
    assert [e["kind"] for e in read_events(debug_dir(trainer)) if e["severity"] != "info"] == []


def test_step_that_sleeps_once_is_a_slow_step_in_forward(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=2)], max_steps=16)
    trainer.fit(SleepsOnceRegressor(sleep_at_step=12, seconds=0.3))

    slow = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "slow_step" and e.get("episode") == "start"]
    at_12 = [e for e in slow if e["step"] == 12]
    assert at_12, slow
    details = at_12[0]["details"]
    assert details["phase"] == "forward"
    assert details["phase_ms"] >= 290
    assert details["step_ms"] > 3 * details["median_step_ms"]
    assert read_report(debug_dir(trainer))["findings"]["slow_step"]["callback"] == "performance"


def test_gradient_accumulation_sums_micro_batches_into_one_step(tmp_path: Path) -> None:
    sleep_per_sample, batch_size, accumulate = 0.010, 2, 3
    planted_ms = 1000 * sleep_per_sample * batch_size * accumulate
    trainer = make_trainer(tmp_path, [PerformanceProfilerCallback(performance_profiling_frequency=1)], max_steps=5,
                           accumulate_grad_batches=accumulate)
    trainer.fit(SleepyLoaderRegressor(sleep_per_sample, batch_size))

    scalars = perf_scalars(trainer)
    assert [step for step, _ in scalars["step_ms"]] == [0, 1, 2, 3, 4]
    data_ms = [value for _, value in scalars["data_ms"]]
    assert 0.9 * planted_ms <= statistics.median(data_ms) <= planted_ms + 40
    for (_, step_ms), (_, samples_per_sec) in zip(scalars["step_ms"], scalars["samples_per_sec"]):
        assert samples_per_sec * step_ms / 1000.0 == pytest.approx(batch_size * accumulate, rel=1e-3)


def test_profiler_window_writes_trace_and_top_operators(tmp_path: Path) -> None:
    callback = PerformanceProfilerCallback(performance_profiling_frequency=1, profile_steps=(3, 2))
    trainer = make_trainer(tmp_path, [callback], max_steps=8)
    trainer.fit(TinyRegressor())

    traces = sorted((debug_dir(trainer) / "profiler").glob("*.pt.trace.json"))
    assert [trace.name for trace in traces] == ["rank0.steps3-4.pt.trace.json"]
    assert json.loads(traces[0].read_text())["traceEvents"]
    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "profiler_trace"]
    assert len(events) == 1 and Path(events[0]["details"]["path"]) == traces[0]
    assert any(name.startswith("aten::") for name in events[0]["details"]["top_cpu"])

    report_md = (debug_dir(trainer) / "report.md").read_text()
    assert "## Top operators (torch.profiler, steps 3-4)" in report_md
    assert "| operator | calls | self CPU ms |" in report_md and "`aten::" in report_md
    # the profiled steps (and the profiler's warm-up step) stay out of the timings
    assert [step for step, _ in perf_scalars(trainer)["step_ms"]] == [0, 1, 5, 6, 7]


def test_invalid_performance_settings_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="slow_step_factor"):
        PerformanceProfilerCallback(slow_step_factor=0.5)
    with pytest.raises(ValueError, match="profile_steps"):
        PerformanceProfilerCallback(profile_steps=(3,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dataloader_bottleneck_share"):
        DebugConfig(dataloader_bottleneck_share=1.5)
    assert PerformanceProfilerCallback(level="advanced").monitor.profile_window == (10, 2)
    assert PerformanceProfilerCallback(level="advanced", profile_steps=(0, 0)).monitor.profile_window is None


class CountingStopwatch(Stopwatch):
    def __init__(self) -> None:
        super().__init__(None)
        self.marks_by_step: dict[int, int] = {}
        self.step = 0

    def mark(self) -> float:
        self.marks_by_step[self.step] = self.marks_by_step.get(self.step, 0) + 1
        return super().mark()


def run_plain_loop(run: Run, steps: int, stopwatch: CountingStopwatch | None = None, batch_size: int = 8) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if stopwatch is not None:
            stopwatch.step = step
        batch = {"x": torch.randn(batch_size, 4), "ids": torch.zeros(batch_size, 5, dtype=torch.long)}
        run.batch_start(step, batch)
        loss = model(batch["x"]).pow(2).mean()
        run.before_backward(step, loss)
        loss.backward()
        run.before_optimizer_step(step, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        run.after_optimizer_step(step + 1)
        run.batch_end()


def test_plain_loop_does_nothing_on_non_check_steps_and_logs_tokens(tmp_path: Path) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    monitor = PerformanceMonitor(DebugConfig(performance_profiling_frequency=10), "loop",
                                 tokens_fn=lambda batch: batch["ids"].numel())
    run = plain_run([monitor], tmp_path, sink=lambda metrics, step: logged.append((step, metrics)))
    stopwatch = CountingStopwatch()
    monitor.stopwatch = stopwatch
    run_plain_loop(run, 21, stopwatch)
    run.finish("finished", 21)

    assert all(stopwatch.marks_by_step.get(step, 0) == 0 for step in range(1, 9)), stopwatch.marks_by_step
    assert sorted(step for step, _ in logged) == [0, 10, 20]
    for _, metrics in logged:
        assert metrics["debug/perf/tokens_per_sec"] == pytest.approx(5 * metrics["debug/perf/samples_per_sec"])


def test_consistently_slower_rank_is_named_as_straggler(tmp_path: Path) -> None:
    """Two ranks simulated by an all_gather of ours and rank 1's (planted, slower) timings, as an all-reduce
    has them: rank 1's forward takes 25 ms longer and we wait those 25 ms for it in the backward."""

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        waiting, slower = local.clone(), local.clone()
        slower[3] += 25.0  # rank 1's forward
        waiting[4] += 25.0  # our backward: the all-reduce waits for rank 1
        waiting[1] += 25.0
        slower[1] += 25.0  # both steps end together, 25 ms later
        return torch.stack([waiting, slower])

    monitor = PerformanceMonitor(DebugConfig(performance_profiling_frequency=1), "loop")
    run = plain_run([monitor], tmp_path, world_size=2, all_gather=all_gather)
    run_plain_loop(run, 20)  # 5 warm-up check steps, then a window of 8
    run.finish("finished", 20)

    stragglers = [e for e in read_events(tmp_path) if e["kind"] == "straggler_rank" and e.get("episode") == "start"]
    assert len(stragglers) == 1
    assert stragglers[0]["details"]["rank"] == 1
    assert "Rank 1" in stragglers[0]["message"]
