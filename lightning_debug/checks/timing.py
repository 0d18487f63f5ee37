"""Step-phase timing on the device's own clock, and the top operators of a torch.profiler run.

Timing a GPU from the host measures how long Python took to *launch* the kernels; CUDA events recorded on the
stream at each phase boundary measure the GPU timeline and are read once completed (``Event.query()``, typically a
step later), never synchronizing. On a CPU the wall clock is the truth and is read at once.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import torch


class Phase(str, enum.Enum):
    """The phases that tile one optimizer step, in order; the value names them in events and metrics.

    >>> [phase.value for phase in Phase], Phase("forward") is Phase.FORWARD
    (['data', 'forward', 'backward', 'optimizer'], True)
    """

    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


PHASES: tuple[Phase, ...] = tuple(Phase)
Mark = Union[float, "torch.cuda.Event"]


class CpuWait:
    """Milliseconds the process's threads spent runnable but waiting for a CPU, summed over its threads
    (``/proc/self/task/*/schedstat``; 0 where it does not exist): on a loaded machine another program's delay is not
    held against the step.

    Every thread counts, not only the one that called: torch's intra-op threads do a step's work too, and the
    calling thread sleeps at their barrier while they wait, so its own wait is as little as half of what the step
    lost (measured on 2 cores beside another torch process). A thread's first reading is its baseline, and one that
    ended is forgotten, so the total never falls. Summed over threads it can exceed an interval's length where they
    waited at once; :meth:`StepTimes.judged` takes at most the interval out.

    >>> wait = CpuWait()
    >>> wait() >= 0.0
    True
    >>> wait.close()
    """

    TASKS = "/proc/self/task"
    RELIST_S = 1.0
    """How long the list of the process's threads is trusted: a thread started since is counted from then on."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._total = 0.0
        self._listed = -math.inf
        self.available = os.path.exists(os.path.join(self.TASKS, str(threading.get_native_id()), "schedstat"))

    def __call__(self) -> float:
        if not self.available:
            return 0.0
        now = time.monotonic()
        if now - self._listed >= self.RELIST_S and not self._relist(now):
            return 0.0
        total = self._total
        for task, fd in list(self._fds.items()):
            try:
                waited = int(os.pread(fd, 128, 0).split()[1]) / 1e6
            except (OSError, ValueError, IndexError):  # the thread ended
                self._forget(task)
                continue
            last = self._last.get(task)
            if last is not None and waited > last:
                total += waited - last
            self._last[task] = waited
        self._total = total
        return total

    def _relist(self, now: float) -> bool:
        try:
            tasks = set(os.listdir(self.TASKS))
        except OSError:
            self.available = False
            return False
        self._listed = now
        for task in set(self._fds) - tasks:
            self._forget(task)
        for task in tasks - set(self._fds):
            with contextlib.suppress(OSError):
                self._fds[task] = os.open(os.path.join(self.TASKS, task, "schedstat"), os.O_RDONLY)
        return True

    def _forget(self, task: str) -> None:
        self._last.pop(task, None)
        fd = self._fds.pop(task, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        for task in list(self._fds):
            self._forget(task)
        self._last.clear()


class Stopwatch:
    """Timestamps at phase boundaries: CUDA events on a CUDA device, ``perf_counter`` otherwise; ``own_ms`` and
    ``cpu_wait_ms`` read the plugin's own time and the process's wait for a CPU so far (ms), which phases leave out.

    >>> watch = Stopwatch(torch.device("cpu"))
    >>> start = watch.mark(); end = watch.mark()
    >>> watch.completed(end), watch.elapsed_ms(start, end) >= 0.0
    (True, True)
    """

    def __init__(self, device: torch.device | None = None, own_ms: Callable[[], float] | None = None,
                 cpu_wait_ms: Callable[[], float] | None = None) -> None:
        self.device = device
        self.uses_cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.own_ms = own_ms
        self.cpu_wait_ms = cpu_wait_ms

    def own(self) -> float:
        return self.own_ms() if self.own_ms is not None else 0.0

    def cpu_wait(self) -> float:
        return self.cpu_wait_ms() if self.cpu_wait_ms is not None else 0.0

    def mark(self) -> Mark:
        if self.uses_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    @staticmethod
    def completed(mark: Mark) -> bool:
        return isinstance(mark, float) or mark.query()

    @staticmethod
    def wait(mark: Mark) -> None:
        """Block until ``mark`` has completed: only at the end of a run, never on a training step."""
        if not isinstance(mark, float):
            mark.synchronize()

    @staticmethod
    def elapsed_ms(start: Mark, end: Mark) -> float:
        if isinstance(start, float) and isinstance(end, float):
            return (end - start) * 1000.0
        return float(start.elapsed_time(end))  # type: ignore[union-attr]


@dataclass
class StepTimes:
    """The measured phases of one optimizer step in milliseconds, the plugin's own time left out; :meth:`judged` also
    leaves out the process's wait for a CPU. ``elements``: of the step's first input tensor, summed over
    micro-batches (what a longer sequence, a larger image or a larger batch makes grow)."""

    step: int
    phases: dict[Phase, float]
    samples: int | None = None
    tokens: int | None = None
    micro_batches: int = 1
    own_ms: float = 0.0
    cpu_waits: dict[Phase, float] = field(default_factory=dict)
    elements: int | None = None

    def judged(self, phase: Phase) -> float:
        return max(0.0, self.phases[phase] - self.cpu_waits.get(phase, 0.0))

    @property
    def judged_step_ms(self) -> float:
        return sum(self.judged(phase) for phase in self.phases)

    @property
    def step_ms(self) -> float:
        return sum(self.phases.values())

    @property
    def samples_per_sec(self) -> float | None:
        return None if not self.samples or self.step_ms <= 0 else self.samples * 1000.0 / self.step_ms

    @property
    def tokens_per_sec(self) -> float | None:
        return None if not self.tokens or self.step_ms <= 0 else self.tokens * 1000.0 / self.step_ms


class PhaseTimer:
    """Contiguous phase intervals of one optimizer step, summed over its micro-batches.

    :meth:`stop` (a batch ends) opens the data wait until the next batch, so ``step = data + forward + backward +
    optimizer`` exactly. The plugin's own time is subtracted, so a check step whose checks take 500 ms is timed
    like any other.

    >>> timer = PhaseTimer(Stopwatch(), step=4, start=time.perf_counter())
    >>> for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
    ...     _ = timer.enter(phase)
    >>> _ = timer.stop()
    >>> times = timer.read()
    >>> times.step, [phase.value for phase in times.phases], times.step_ms >= times.phases[Phase.FORWARD]
    (4, ['data', 'forward', 'backward', 'optimizer'], True)
    """

    def __init__(self, stopwatch: Stopwatch, step: int, start: Mark | None = None, start_own: float | None = None,
                 start_wait: float | None = None) -> None:
        self.stopwatch = stopwatch
        self.step = step
        self.intervals: list[tuple[Phase, Mark, Mark, float, float]] = []
        self.current: Phase | None = Phase.DATA if start is not None else None
        self.since: Mark | None = start
        self.since_own = stopwatch.own() if start_own is None else start_own
        self.since_wait = stopwatch.cpu_wait() if start_wait is None else start_wait
        self.last_stop: Mark | None = None
        self._closed = 0
        self.samples: int | None = 0
        self.tokens: int | None = None
        self.elements: int | None = 0
        self.micro_batches = 0
        self.saw_optimizer = False
        self.excluded = False
        self.where: dict[str, int] = {}

    def enter(self, phase: Phase | str) -> Mark:
        if type(phase) is not Phase:
            phase = Phase(phase)
        mark = self.stopwatch.mark()
        own, wait = self.stopwatch.own(), self.stopwatch.cpu_wait()
        if self.current is not None and self.since is not None:
            self.intervals.append((self.current, self.since, mark, own - self.since_own, wait - self.since_wait))
        self.current, self.since, self.since_own, self.since_wait = phase, mark, own, wait
        if phase is Phase.OPTIMIZER:
            self.saw_optimizer = True
        elif phase is Phase.FORWARD:
            self.micro_batches += 1
        return mark

    def restart(self) -> None:
        """The phase in progress starts over now (time outside training steps is no data wait)."""
        self.since, self.since_own, self.since_wait = self.stopwatch.mark(), self.stopwatch.own(), self.stopwatch.cpu_wait()

    def stop(self) -> Mark:
        self.last_stop = self.enter(Phase.DATA)
        self._closed = len(self.intervals)
        return self.last_stop

    def add_samples(self, samples: int | None, tokens: int | None, elements: int | None = None) -> None:
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        self.elements = None if elements is None or self.elements is None else self.elements + elements
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens

    @property
    def closed_intervals(self) -> list[tuple[Phase, Mark, Mark, float, float]]:
        """The intervals up to the last batch end (the trailing data wait belongs to the next step)."""
        return self.intervals[: self._closed]

    def ready(self) -> bool:
        return all(self.stopwatch.completed(end) for _, _, end, _, _ in self.closed_intervals)

    def wait(self) -> None:
        for _, _, end, _, _ in self.closed_intervals:
            self.stopwatch.wait(end)

    def read(self) -> StepTimes:
        phases = dict.fromkeys(PHASES, 0.0)
        waits = dict.fromkeys(PHASES, 0.0)
        own_total = 0.0
        for phase, start, end, own, wait in self.closed_intervals:
            elapsed = self.stopwatch.elapsed_ms(start, end)
            own = min(max(own, 0.0), elapsed)
            own_total += own
            phases[phase] = phases.get(phase, 0.0) + elapsed - own
            waits[phase] = waits.get(phase, 0.0) + min(max(wait, 0.0), elapsed - own)
        return StepTimes(self.step, phases, self.samples or None, self.tokens, max(self.micro_batches, 1), own_total,
                         waits, self.elements or None)


def first_tensor(batch: Any, _depth: int = 0) -> torch.Tensor | None:
    """The first tensor in a tensor, tuple, list or mapping, at most four levels deep (None: there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if _depth >= 4:
        return None
    if isinstance(batch, Mapping):
        values: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        found = first_tensor(value, _depth + 1)
        if found is not None:
            return found
    return None


def infer_batch_size(batch: Any) -> int | None:
    """Dimension 0 of :func:`first_tensor`.

    >>> infer_batch_size({"input_ids": torch.zeros(8, 128), "labels": torch.zeros(8)})
    8
    >>> infer_batch_size([torch.zeros(3, 2), torch.zeros(3)]), infer_batch_size("text")
    (3, None)
    """
    tensor = first_tensor(batch)
    if tensor is None:
        return None
    return int(tensor.shape[0]) if tensor.ndim else 1


@dataclass
class OperatorRow:
    """One operator of a torch.profiler run, times in milliseconds."""

    name: str
    calls: int
    self_cpu_ms: float
    cpu_total_ms: float
    self_device_ms: float


def top_operators(key_averages: Iterable[Any], limit: int = 15, by: str = "self_cpu_ms") -> list[OperatorRow]:
    """The ``limit`` operators of ``profiler.key_averages()`` with the most self time (``by``: ``"self_cpu_ms"`` or
    ``"self_device_ms"``), without the profiler's own ``ProfilerStep#N`` spans.

    >>> from types import SimpleNamespace as Op
    >>> ops = [Op(key="aten::mm", count=4, self_cpu_time_total=900.0, cpu_time_total=900.0),
    ...        Op(key="aten::add", count=2, self_cpu_time_total=100.0, cpu_time_total=150.0)]
    >>> [(row.name, row.self_cpu_ms) for row in top_operators(ops, limit=1)]
    [('aten::mm', 0.9)]
    """
    rows = []
    for event in key_averages:
        if str(event.key).startswith("ProfilerStep"):  # the profiler's own per-step span, not an operator
            continue
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:  # older torch
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        rows.append(OperatorRow(str(event.key), int(event.count), float(event.self_cpu_time_total) / 1000.0,
                                float(event.cpu_time_total) / 1000.0, float(device_us or 0.0) / 1000.0))
    rows = [row for row in rows if getattr(row, by) > 0]
    rows.sort(key=lambda row: getattr(row, by), reverse=True)
    return rows[:limit]
