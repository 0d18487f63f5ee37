"""Step-phase timing (checks/timing.py) on a scripted clock: what the plugin's own time and the CPU wait take
out of each phase, micro-batches, throughput and the profiler's top operators. No Trainer, milliseconds."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_debug.checks.timing import (
    CpuWait,
    Phase,
    PhaseTimer,
    Stopwatch,
    StepTimes,
    infer_batch_size,
    top_operators,
)


class ScriptedClock(Stopwatch):
    """A stopwatch whose marks, own time and CPU wait are set by the test (seconds, ms, ms)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), own_ms=lambda: self.own_total, cpu_wait_ms=lambda: self.wait_total)
        self.now = 0.0
        self.own_total = 0.0
        self.wait_total = 0.0

    def mark(self) -> float:
        return self.now

    def advance(self, ms: float, own: float = 0.0, wait: float = 0.0) -> None:
        self.now += ms / 1000.0
        self.own_total += own
        self.wait_total += wait


def test_the_plugins_own_time_and_the_cpu_wait_are_taken_out_of_the_phase_they_fall_in() -> None:
    clock = ScriptedClock()
    timer = PhaseTimer(clock, step=3, start=clock.mark())
    clock.advance(5)  # data
    timer.enter(Phase.FORWARD)
    clock.advance(40, own=30)  # a check step's checks ran inside the forward
    timer.enter(Phase.BACKWARD)
    clock.advance(20, wait=8)  # another program had the CPU
    timer.enter(Phase.OPTIMIZER)
    clock.advance(4)
    timer.stop()
    clock.advance(100)  # the next batch's data wait belongs to the next step
    times = timer.read()
    assert times.phases == pytest.approx({Phase.DATA: 5, Phase.FORWARD: 10, Phase.BACKWARD: 20, Phase.OPTIMIZER: 4})
    assert times.own_ms == pytest.approx(30) and times.step_ms == pytest.approx(39)
    assert times.judged(Phase.BACKWARD) == pytest.approx(12) and times.judged_step_ms == pytest.approx(31)


def test_own_time_never_makes_a_phase_negative() -> None:
    clock = ScriptedClock()
    timer = PhaseTimer(clock, step=0, start=clock.mark())
    timer.enter(Phase.FORWARD)
    clock.advance(2, own=50, wait=50)  # counters read around a phase may overlap its edges
    timer.stop()
    times = timer.read()
    assert times.phases[Phase.FORWARD] == 0.0 and times.own_ms == pytest.approx(2)
    assert times.cpu_waits[Phase.FORWARD] == 0.0


def test_micro_batches_add_up_within_one_step() -> None:
    clock = ScriptedClock()
    timer = PhaseTimer(clock, step=1, start=clock.mark())
    for _ in range(3):
        timer.enter(Phase.FORWARD)
        clock.advance(10)
        timer.enter(Phase.BACKWARD)
        clock.advance(20)
        timer.add_samples(8, tokens=None)
        timer.stop()
        clock.advance(1)
    timer.enter(Phase.OPTIMIZER)
    clock.advance(3)
    timer.stop()
    times = timer.read()
    assert times.micro_batches == 3 and times.samples == 24 and times.tokens is None
    assert times.phases[Phase.FORWARD] == pytest.approx(30) and times.phases[Phase.BACKWARD] == pytest.approx(60)
    assert times.phases[Phase.DATA] == pytest.approx(3) and timer.saw_optimizer


def test_an_unknown_batch_size_makes_the_step_samples_unknown() -> None:
    timer = PhaseTimer(ScriptedClock(), step=0)
    timer.add_samples(8, tokens=100)
    timer.add_samples(None, tokens=50)
    timer.add_samples(8, tokens=None)
    assert timer.samples is None and timer.tokens == 150


def test_restart_drops_time_outside_training_from_the_data_wait() -> None:
    clock = ScriptedClock()
    timer = PhaseTimer(clock, step=0, start=clock.mark())
    clock.advance(500)  # validation ran here
    timer.restart()
    clock.advance(2)
    timer.enter(Phase.FORWARD)
    clock.advance(1)
    timer.stop()
    assert timer.read().phases[Phase.DATA] == pytest.approx(2)


def test_throughput_of_a_step() -> None:
    times = StepTimes(0, {Phase.DATA: 100.0, Phase.FORWARD: 400.0}, samples=32, tokens=4096)
    assert times.samples_per_sec == pytest.approx(64.0) and times.tokens_per_sec == pytest.approx(8192.0)
    assert StepTimes(0, {Phase.DATA: 0.0}, samples=32).samples_per_sec is None
    assert StepTimes(0, {Phase.DATA: 10.0}).tokens_per_sec is None


def test_top_operators_by_device_time_with_the_older_attribute_name() -> None:
    ops = [SimpleNamespace(key="ProfilerStep#3", count=1, self_cpu_time_total=9e6, cpu_time_total=9e6,
                           self_device_time_total=9e6),
           SimpleNamespace(key="aten::mm", count=4, self_cpu_time_total=100.0, cpu_time_total=100.0,
                           self_cuda_time_total=5000.0),
           SimpleNamespace(key="aten::add", count=2, self_cpu_time_total=900.0, cpu_time_total=900.0,
                           self_device_time_total=1000.0),
           SimpleNamespace(key="aten::view", count=9, self_cpu_time_total=50.0, cpu_time_total=50.0,
                           self_device_time_total=0.0)]
    rows = top_operators(ops, by="self_device_ms")
    assert [(row.name, row.self_device_ms) for row in rows] == [("aten::mm", 5.0), ("aten::add", 1.0)]
    assert [row.name for row in top_operators(ops)] == ["aten::add", "aten::mm", "aten::view"]


def test_batch_size_of_nested_and_odd_batches() -> None:
    assert infer_batch_size(torch.tensor(3.0)) == 1
    assert infer_batch_size({"meta": "x", "pair": (None, torch.zeros(5, 2))}) == 5
    assert infer_batch_size([[[[[torch.zeros(4)]]]]]) is None  # deeper than anyone nests a batch
    assert infer_batch_size(None) is None


def test_cpu_wait_counts_every_thread_of_the_process() -> None:
    """torch's intra-op threads do the step's work while the calling thread sleeps at their barrier: threads that
    burn a CPU each, twice as many as this process may use, wait for one; the caller, asleep, waits for none."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    wait = CpuWait()
    if not wait.available:
        pytest.skip("no /proc/self/task/*/schedstat")
    own = CpuWait.TASKS + f"/{threading.get_native_id()}/schedstat"

    def own_wait() -> float:
        with open(own) as file:
            return int(file.read().split()[1]) / 1e6

    stop = threading.Event()
    burners = [threading.Thread(target=burn, args=(stop,)) for _ in range(2 * cores)]
    for burner in burners:
        burner.start()
    try:
        time.sleep(0.05)
        start, start_own = wait(), own_wait()
        time.sleep(0.5)
        waited, waited_own = wait() - start, own_wait() - start_own
    finally:
        stop.set()
        for burner in burners:
            burner.join()
        wait.close()
    assert waited >= 150.0, waited  # about (threads - cores) x 500 ms
    assert waited_own < 50.0, waited_own


def burn(stop: threading.Event) -> None:
    matrix = torch.randn(96, 96)
    with torch.inference_mode():
        while not stop.is_set():
            matrix @ matrix  # torch lets the GIL go: each thread wants a CPU of its own


def test_a_wait_beyond_its_phase_leaves_nothing_of_it() -> None:
    """Threads that waited at once sum to more than the interval: the judged phase is then 0, never negative."""
    times = StepTimes(3, {phase: 2.0 for phase in Phase}, cpu_waits={Phase.FORWARD: 5.0, Phase.BACKWARD: 1.5})
    assert times.judged(Phase.FORWARD) == 0.0 and times.judged(Phase.BACKWARD) == 0.5
    assert times.judged_step_ms == pytest.approx(4.5)


def test_cpu_wait_without_schedstat_reads_zero() -> None:
    wait = CpuWait()
    wait.available = False
    assert wait() == 0.0
    wait.close()
