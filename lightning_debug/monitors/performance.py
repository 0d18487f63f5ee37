"""Where each optimizer step's time goes, what stalls it, and torch.profiler over a few steps.

The monitor is driven by the run's events at phase boundaries (a batch starts, backward starts,
the optimizer step starts, a batch ends), so a Lightning callback, an Accelerate loop and a plain
training loop use it the same way. On a non-check step it does nothing but an integer comparison
per boundary.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import os
import warnings
from collections import Counter, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_debug.checks.robust import median, robust_sigma
from lightning_debug.checks.timing import (
    PHASES,
    CpuWait,
    Mark,
    PhaseTimer,
    StepTimes,
    Stopwatch,
    infer_batch_size,
    top_operators,
)
from lightning_debug.config import Area, DebugConfig, DebugLevel
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where
from lightning_debug.core.stats import DistributionStats, Window

PERF_KINDS = {Kind.SLOW_STEP, Kind.DATALOADER_BOTTLENECK}
DEFAULT_PROFILE_WINDOW = (10, 5)
SYNC_DEBUG_WINDOW = (5, 3)
RECENT_STEPS = 50
MIN_HISTORY = 5
# A slow step is a robust outlier: above the median by (slow_step_factor - 1) medians, by SLOW_MAD_Z
# robust standard deviations (1.4826 MAD) and by MIN_SLOW_EXCESS_MS. It is a warning when it recurs
# (SLOW_MIN_FLAGGED of the last SLOW_WINDOW timed steps); one outlier alone is reported (info) only
# when it is far out (SLOW_LONE_FACTOR x the median and SLOW_LONE_MS more). A busy machine delays
# bursts of steps by tens of milliseconds beyond the measured wait for a CPU (a busy hyperthread
# sibling, a hypervisor's steal time), hence the absolute floor.
SLOW_MAD_Z = 6.0
MIN_SLOW_EXCESS_MS = 50.0
SLOW_WINDOW = 10
SLOW_MIN_FLAGGED = 3
SLOW_LONE_FACTOR = 20.0
SLOW_LONE_MS = 250.0
# The data wait is a bottleneck when its median share over DATA_WINDOW timed steps is above the
# configured share, DATA_MIN_SHARE_OF_STEPS of those steps are above it too, and the median wait is
# at least MIN_DATA_WAIT_MS (the loop's own overhead between batches is a millisecond or two, more
# on a loaded machine).
DATA_WINDOW = 10
MIN_DATA_HISTORY = 6
MIN_DATA_WAIT_MS = 5.0
DATA_MIN_SHARE_OF_STEPS = 0.7
# A straggler is slower before the gradient all-reduce (data wait + forward) than the median of the
# other ranks by STRAGGLER_MARGIN of theirs, by STRAGGLER_STEP_SHARE of the step and by STRAGGLER_MIN_MS,
# on STRAGGLER_MIN_FLAGGED of STRAGGLER_WINDOW check steps, after the first STRAGGLER_WARMUP gathered
# check steps (lazy initialisation differs between ranks). Rank 0's extra logging is no straggler.
STRAGGLER_WARMUP = 5
STRAGGLER_WINDOW = 8
STRAGGLER_MIN_FLAGGED = 6
STRAGGLER_MARGIN = 0.5
STRAGGLER_STEP_SHARE = 0.2
STRAGGLER_MIN_MS = 5.0
MAX_PENDING = 16
TOP_OPERATORS = 15
GATHER_FIELDS = ("step", "step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms")
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])

PHASE_HINTS = {
    "data": "the data wait grew: a slow sample or shard, data-loader workers restarting at an epoch boundary, "
            "disk or network I/O, or work between steps (checkpointing, logging, a callback)",
    "forward": "the training_step itself was slow: a new input shape (recompilation, cuDNN autotuning), a host "
               "sync such as .item() or printing a tensor, or I/O inside the step",
    "backward": "the backward pass was slow: a new graph shape, or waiting for another rank in the gradient "
                "all-reduce",
    "optimizer": "the optimizer step was slow: optimizer state allocated lazily on the first step, a hook or "
                 "an LR scheduler doing extra work",
}

SizeFn = Callable[[Any], int]


def loader_settings(loader: Any) -> dict[str, Any] | None:
    """The settings of a DataLoader that decide its throughput (duck-typed; None if unknown).

    Accepts a DataLoader, a list or dict of them (the first one counts), or an object with
    ``iterables`` (Lightning's CombinedLoader).

    Example::

        >>> from torch.utils.data import DataLoader
        >>> loader_settings(DataLoader(list(range(8)), batch_size=4))["num_workers"]
        0
    """
    for _ in range(4):
        if loader is None or hasattr(loader, "num_workers"):
            break
        if hasattr(loader, "iterables"):
            loader = loader.iterables
        elif isinstance(loader, Mapping):
            loader = next(iter(loader.values()), None)
        elif isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        else:
            return None
    if loader is None or not hasattr(loader, "num_workers"):
        return None
    return {"num_workers": int(loader.num_workers), "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "prefetch_factor": getattr(loader, "prefetch_factor", None),
            "batch_size": getattr(loader, "batch_size", None)}


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def loader_advice(settings: Mapping[str, Any] | None, uses_cuda: bool, cpus: int) -> list[str]:
    """What to change in the DataLoader when the training loop waits for it.

    Example::

        >>> loader_advice({"num_workers": 0, "pin_memory": False, "persistent_workers": False}, True, 8)[0]
        'num_workers=0 loads every batch in the training process: set num_workers to 4-8 (this machine has 8 CPUs).'
    """
    if settings is None:
        return ["Use worker processes (DataLoader(num_workers=...)) and make __getitem__ cheaper "
                "(decode, resize and tokenize ahead of time)."]
    advice = []
    workers = settings.get("num_workers", 0)
    suggested = f"{min(4, cpus)}-{max(min(8, cpus), 1)}" if cpus > 4 else str(max(cpus - 1, 1))
    if workers == 0:
        advice.append(f"num_workers=0 loads every batch in the training process: set num_workers to {suggested} "
                      f"(this machine has {cpus} CPUs).")
    else:
        advice.append(f"{workers} worker(s) cannot keep up: raise num_workers (this machine has {cpus} CPUs), "
                      "raise prefetch_factor, or make __getitem__ cheaper (pre-decode, cache, smaller files).")
        if not settings.get("persistent_workers"):
            advice.append("persistent_workers=True keeps the workers alive between epochs instead of restarting "
                          "them (and re-running the dataset's setup) every epoch.")
    if uses_cuda and not settings.get("pin_memory"):
        advice.append("pin_memory=True makes host-to-GPU copies faster and lets them overlap with compute.")
    return advice


class PerformanceMonitor(Monitor):
    """Step-phase timing, throughput, slow steps, data-loader stalls, stragglers, torch.profiler.

    See :class:`lightning_debug.PerformanceProfilerCallback` for the behaviour users rely on. A
    plain training loop drives it through a run, with one call per phase boundary::

        >>> import torch
        >>> from lightning_debug import DebugConfig
        >>> from lightning_debug.core.monitor import RunContext
        >>> from lightning_debug.run import Run
        >>> monitor = PerformanceMonitor(DebugConfig(performance_profiling_frequency=1), "loop")
        >>> run = Run(DebugConfig(save_debug_info=False), RunContext(), [monitor])
        >>> model = torch.nn.Linear(4, 1); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> run.start(0)
        >>> for step in range(3):
        ...     batch = torch.randn(8, 4)
        ...     run.batch_start(step, batch)
        ...     loss = model(batch).pow(2).mean()
        ...     run.before_backward(step, loss); loss.backward()
        ...     _ = run.before_optimizer_step(step, optimizer); optimizer.step(); optimizer.zero_grad()
        ...     run.after_optimizer_step(step + 1); run.batch_end(batch)
        >>> run.finalize(2)
        >>> monitor.report_section()["stats"]["step_time_ms"]["count"]
        3

    Args:
        config: The run's configuration (frequency, level, thresholds, profiler window).
        source: The name written into events (``"callback"``).
        batch_size_fn: ``batch -> number of samples``, when the first tensor's dimension 0 is not it.
        tokens_fn: ``batch -> number of tokens``, to log ``debug/perf/tokens_per_sec``.

    The device, the number of processes (samples/s is this process's times the world size), the
    rank (names trace files) and the all-gather (per-rank step times compared on check steps)
    come from the run's context at :meth:`start`.
    """

    area = Area.PERFORMANCE
    kinds = frozenset({Kind.SLOW_STEP, Kind.DATALOADER_BOTTLENECK, Kind.STRAGGLER_RANK})
    events = frozenset({Event.START, Event.EPOCH_START, Event.BATCH_START, Event.BEFORE_BACKWARD,
                        Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END, Event.EVALUATION})
    frequency_field = "performance_profiling_frequency"

    def __init__(self, config: DebugConfig, source: str = "PerformanceProfilerCallback", *,
                 batch_size_fn: SizeFn | None = None, tokens_fn: SizeFn | None = None) -> None:
        super().__init__(config, source)
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.stopwatch = Stopwatch(None)
        self._cpu_wait = CpuWait()
        self.world_size = 1
        self.rank = 0
        self.all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.loader: dict[str, Any] | None = None
        self.stats: dict[str, DistributionStats] = {name: DistributionStats() for name in ("step", *PHASES, "samples_per_sec",
                                                                              "tokens_per_sec")}
        self.profile_window = self._resolve_profile_window(config)
        self.sync_window = SYNC_DEBUG_WINDOW if config.level >= DebugLevel.EXPERT else None
        self.profiler_traces: list[dict[str, Any]] = []
        self.sync_sites: list[dict[str, Any]] | None = None
        self.excluded_steps = 0
        self.dropped_measurements = 0
        self.own_stats = DistributionStats()  # the plugin's own time inside timed steps, left out of them
        self.cpu_wait_stats = DistributionStats()  # waiting for a CPU another program had: not held against steps
        self._reset_run_state()

    @staticmethod
    def _resolve_profile_window(config: DebugConfig) -> tuple[int, int] | None:
        window = config.profile_steps
        if window is None and config.level >= DebugLevel.ADVANCED:
            window = DEFAULT_PROFILE_WINDOW
        return window if window is not None and window[1] > 0 else None

    def _reset_run_state(self) -> None:
        self._timer: PhaseTimer | None = None
        self._next_start: tuple[int, Mark, float, float] | None = None
        self._pending: list[PhaseTimer] = []
        self._gathers: deque[Readback] = deque()
        self._latest: StepTimes | None = None
        self._where: Where = {"epoch": 0, "batch": 0}
        self._recent: dict[str, Window] = {name: Window(RECENT_STEPS) for name in ("step", *PHASES)}
        self._data_window: deque[tuple[float, float]] = deque(maxlen=DATA_WINDOW)
        self._slow_flags: deque[bool] = deque(maxlen=SLOW_WINDOW)
        self._gathered = 0
        self._straggler_window: deque[tuple[int | None, list[list[float]]]] = deque(maxlen=STRAGGLER_WINDOW)
        self._profiler: Any = None
        self._profiler_step = -1
        self._profile_done = False
        self._sync_catcher: Any = None
        self._sync_records: list[warnings.WarningMessage] = []
        self._sync_previous_mode = 0
        self._sync_done = False
        windows = [self.profile_window, self.sync_window if self.stopwatch.uses_cuda else None]
        self._windows_until = max((start + length for start, length in filter(None, windows)), default=-1)

    # --- events ---------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Start (or restart) timing a run on the context's device, processes and loader."""
        context = self.context
        self.session.timed_steps = self.schedule.is_due
        self.session.own_time.enabled = True  # the run counts its own time from now on, and phases leave it out
        self.stopwatch.cpu_wait_ms = None
        self._cpu_wait.close()
        stopwatch = Stopwatch(context.device(), self.session.own_time.total_ms)
        if not stopwatch.uses_cuda:  # a host thread's wait for a CPU says nothing of the GPU's timeline
            stopwatch.cpu_wait_ms = self._cpu_wait
        self.stopwatch = stopwatch
        self.world_size, self.rank = context.world_size, context.rank
        self.all_gather = context.all_gather()
        loader = context.train_loader()
        if loader is not None:
            self.describe_loader(loader)
        self._reset_run_state()

    def epoch_start(self, step: int) -> None:
        self.describe_loader(self.context.train_loader())
        self.reset_data_clock(step)

    def evaluation(self, step: int, started: bool) -> None:
        if not started:
            self.reset_data_clock(step)

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self.backward_start()

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        self.optimizer_start()
        return Decision.CONTINUE

    def batch_end(self, step: int, batch: Any) -> None:
        self._batch_end(step, self.context.where(), batch)

    def describe_loader(self, loader: Any) -> None:
        """The training DataLoader (or its settings dict), quoted in ``dataloader_bottleneck`` advice."""
        self.loader = dict(loader) if isinstance(loader, Mapping) and "num_workers" in loader else \
            loader_settings(loader)

    def reset_data_clock(self, step: int) -> None:
        """Time spent outside training steps (validation, epoch boundaries) is no data wait: restart the clock."""
        timer = self._timer
        if timer is not None and timer.current == "data":
            timer.restart()
        elif self.due(step):
            self._next_start = (step, self.stopwatch.mark(), self.stopwatch.own(), self.stopwatch.cpu_wait())

    # --- phase boundaries -----------------------------------------------------------------------
    def batch_start(self, step: int, batch: Any, captured: Any = None) -> None:
        """A batch of optimizer step ``step`` starts; the data wait ends here."""
        if step <= self._windows_until and self._window_boundary(step):
            self.reset_data_clock(step)
        if not self.schedule.is_due(step):
            return
        timer = self._timer
        if timer is not None and timer.step != step:
            self._complete(timer, gather=False)
            timer = None
        if timer is None:
            start, start_own, start_wait = (self._next_start[1:] if self._next_start is not None and
                                            self._next_start[0] == step else (None, None, None))
            timer = self._timer = PhaseTimer(self.stopwatch, step, start, start_own, start_wait)
            self._next_start = None
        timer.enter("forward")
        timer.excluded = timer.excluded or self._profiler is not None or self._sync_catcher is not None
        samples = self.batch_size_fn(batch) if self.batch_size_fn is not None else infer_batch_size(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else None
        timer.add_samples(None if samples is None else int(samples), None if tokens is None else int(tokens))

    def backward_start(self) -> None:
        """The loss is computed; the forward phase ends."""
        if self._timer is not None:
            self._timer.enter("backward")

    def optimizer_start(self) -> None:
        """Gradients are ready (before ``optimizer.step``); the backward phase ends."""
        if self._timer is not None:
            self._timer.enter("optimizer")

    def _batch_end(self, step: int, where: Where, batch: object | None = None) -> None:
        """A batch of optimizer step ``step`` ends. Under gradient accumulation the step ends with the
        batch in which :meth:`optimizer_start` was called (or when a batch of a later step starts)."""
        timer = self._timer
        handed_over = False
        if timer is not None:
            if timer.step == step:
                end = timer.stop()
                timer.where = dict(where)
                if timer.saw_optimizer:
                    self._complete(timer, gather=True)
                    if self.due(step + 1):
                        self._next_start, handed_over = (step + 1, end, timer.since_own, timer.since_wait), True
            else:
                self._complete(timer, gather=False)
        if self._timer is None and not handed_over and self.due(step + 1):
            self._next_start = (step + 1, self.stopwatch.mark(), self.stopwatch.own(), self.stopwatch.cpu_wait())
        if self._pending or self._gathers:
            self._where = dict(where)
            self._poll()

    def finalize(self, step: int) -> None:
        """The end of the run (or an exception): read what is left, stop the profiler, close episodes."""
        where = self._where = dict(self.context.where())
        timer = self._timer
        if timer is not None and timer.last_stop is not None and timer.saw_optimizer:
            self._complete(timer, gather=False)
        self._timer = None
        for pending in self._pending:
            try:
                pending.wait()
            except Exception:  # a failed CUDA context must not hide the run's own error
                pending.excluded = True
        self._poll(final=True)
        self._stop_profiler()
        self._end_sync_window(step, where)
        super().finalize(step)

    def restore(self) -> None:
        """Undo global changes (profiler running, sync debug mode) whatever happened."""
        self._cpu_wait.close()
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            try:
                profiler.stop()
            except Exception:
                pass
        if self._sync_catcher is not None:
            torch.cuda.set_sync_debug_mode(self._sync_previous_mode)
            self._sync_catcher.__exit__(None, None, None)
            self._sync_catcher = None

    # --- measurements -----------------------------------------------------------------------------
    def _complete(self, timer: PhaseTimer, gather: bool) -> None:
        if self._timer is timer:
            self._timer = None
        if timer.last_stop is not None:
            self._pending.append(timer)
            if len(self._pending) > MAX_PENDING:
                self._pending.pop(0)
                self.dropped_measurements += 1
        self._where = dict(timer.where) or self._where
        self._poll()
        if gather and self.all_gather is not None and self.world_size > 1:
            self._gather()

    def _poll(self, final: bool = False) -> None:
        while self._pending and self._pending[0].ready():
            timer = self._pending.pop(0)
            self._process(timer)
        if final:
            self._pending.clear()
        while self._gathers and (final or self._gathers[0].ready()):
            readback = self._gathers.popleft()
            try:
                values = readback.values()
            except Exception:
                continue
            self._check_stragglers(values)

    def _process(self, timer: PhaseTimer) -> None:
        if timer.excluded or timer.step in self.session.instrumented_steps:
            self.excluded_steps += 1
            return
        times = timer.read()
        where = timer.where or self._where
        step_ms = times.step_ms
        for phase in PHASES:
            self.stats[phase].add(times.phases[phase])
        self.stats["step"].add(step_ms)
        self.own_stats.add(times.own_ms)
        if self.stopwatch.cpu_wait_ms is not None:
            self.cpu_wait_stats.add(sum(times.cpu_waits.values()))
        if times.samples_per_sec is not None:
            self.stats["samples_per_sec"].add(times.samples_per_sec * self.world_size)
        if times.tokens_per_sec is not None:
            self.stats["tokens_per_sec"].add(times.tokens_per_sec * self.world_size)
        if self.config.log_performance:
            metrics = {"debug/perf/step_ms": step_ms}
            metrics.update({f"debug/perf/{phase}_ms": times.phases[phase] for phase in PHASES})
            if times.samples_per_sec is not None:
                metrics["debug/perf/samples_per_sec"] = times.samples_per_sec * self.world_size
            if times.tokens_per_sec is not None:
                metrics["debug/perf/tokens_per_sec"] = times.tokens_per_sec * self.world_size
            self.log_metrics(times.step, metrics)
        self._check_slow_step(times, where)
        self._check_data_wait(times, where)
        self.close_episodes(times.step, where, PERF_KINDS)
        self._recent["step"].add(times.judged_step_ms)
        for phase in PHASES:
            self._recent[phase].add(times.judged(phase))
        self._latest = times

    def slow_threshold_ms(self) -> float | None:
        """The step time above which a step is an outlier of this run (None until enough history):
        see ``SLOW_MAD_Z`` and ``MIN_SLOW_EXCESS_MS``."""
        history = self._recent["step"]
        if len(history) < MIN_HISTORY:
            return None
        median = history.median()
        sigma = robust_sigma(list(history.values), median)
        return median + max((self.config.slow_step_factor - 1) * median, SLOW_MAD_Z * sigma,
                            MIN_SLOW_EXCESS_MS)

    def _check_slow_step(self, times: StepTimes, where: Where) -> None:
        threshold = self.slow_threshold_ms()
        if threshold is None:
            return
        median, step_ms = self._recent["step"].median(), times.step_ms
        judged = times.judged_step_ms
        outlier = judged > threshold
        self._slow_flags.append(outlier)
        if not outlier:
            return
        flagged = sum(self._slow_flags)
        recurring = flagged >= SLOW_MIN_FLAGGED
        if not recurring and not (judged >= SLOW_LONE_FACTOR * median and judged - median >= SLOW_LONE_MS):
            return
        excess = {phase: times.judged(phase) - self._recent[phase].median() for phase in PHASES}
        phase = max(excess, key=lambda name: excess[name])
        phase_median = self._recent[phase].median()
        how_often = (f"{flagged} of the last {len(self._slow_flags)} timed steps were this slow" if recurring else
                     "a single step so far (it becomes a warning if it recurs)")
        self.record(Finding(
            Kind.SLOW_STEP, Severity.WARNING if recurring else Severity.INFO,
            f"Step {times.step} took {step_ms:.1f} ms, {step_ms / median:.1f}x the recent median of {median:.1f} ms "
            f"({how_often}); the {phase} phase took {times.phases[phase]:.1f} ms (median {phase_median:.1f} ms), so "
            f"{PHASE_HINTS[phase]}.",
            {"phase": phase, "step_ms": step_ms, "median_step_ms": median, "factor": step_ms / median,
             "phase_ms": times.phases[phase], "median_phase_ms": phase_median, "threshold_ms": threshold,
             "slow_steps": flagged, "window_steps": len(self._slow_flags), "recurring": recurring,
             "phases_ms": dict(times.phases), "plugin_ms": times.own_ms,
             "cpu_wait_ms": sum(times.cpu_waits.values()),
             "threshold_factor": self.config.slow_step_factor}),
            times.step, where, key=phase if recurring else f"{phase} (once)")

    def _check_data_wait(self, times: StepTimes, where: Where) -> None:
        self._data_window.append((times.judged("data"), times.judged_step_ms))
        if len(self._data_window) < MIN_DATA_HISTORY:
            return
        data_median = median(d for d, _ in self._data_window)
        shares = [d / s if s > 0 else 0.0 for d, s in self._data_window]
        share = median(shares)
        limit = self.config.dataloader_bottleneck_share
        above = sum(value >= limit for value in shares)
        if share < limit or data_median < MIN_DATA_WAIT_MS or above < DATA_MIN_SHARE_OF_STEPS * len(shares):
            return
        step_median = median(s for _, s in self._data_window)
        settings = self.loader or {}
        advice = loader_advice(self.loader, self.stopwatch.uses_cuda, usable_cpus())
        self.record(Finding(
            Kind.DATALOADER_BOTTLENECK, Severity.WARNING,
            f"The training loop waits for data {100 * share:.0f}% of the step time (medians over the last "
            f"{len(self._data_window)} check steps: {data_median:.1f} ms of {step_median:.1f} ms per step). "
            + " ".join(advice),
            {"data_ms": data_median, "step_ms": step_median, "share": share,
             "window_check_steps": len(self._data_window), "threshold_share": self.config.dataloader_bottleneck_share,
             "steps_above_share": above, "min_data_ms": MIN_DATA_WAIT_MS,
             "num_workers": settings.get("num_workers"), "pin_memory": settings.get("pin_memory"),
             "persistent_workers": settings.get("persistent_workers"),
             "prefetch_factor": settings.get("prefetch_factor"), "cpus": usable_cpus(), "advice": advice}),
            times.step, where)

    # --- stragglers -------------------------------------------------------------------------------
    def _gather(self) -> None:
        latest = self._latest
        values = ([float(latest.step), latest.judged_step_ms] + [latest.judged(p) for p in PHASES]
                  if latest is not None else [math.nan] * len(GATHER_FIELDS))
        host = torch.tensor(values, dtype=torch.float64)
        if self.stopwatch.uses_cuda:
            local = host.pin_memory().to(self.stopwatch.device, non_blocking=True)
        else:
            local = host
        gathered = self.all_gather(local)  # type: ignore[misc]
        self._gathers.append(Readback(gathered.reshape(-1), blocking=False))
        self._poll()

    def _check_stragglers(self, values: list[float]) -> None:
        width = len(GATHER_FIELDS)
        rows = [values[i:i + width] for i in range(0, len(values) - width + 1, width)]
        if len(rows) < 2 or any(not all(math.isfinite(v) for v in row) for row in rows):
            return
        if len({row[0] for row in rows}) != 1:
            return
        step = int(rows[0][0])
        self._gathered += 1
        if self._gathered <= STRAGGLER_WARMUP:
            return
        before_sync = [row[2] + row[3] for row in rows]
        slowest = max(range(len(rows)), key=lambda rank: before_sync[rank])
        others = sorted(v for rank, v in enumerate(before_sync) if rank != slowest)
        typical = others[len(others) // 2]
        step_ms = median(row[1] for row in rows)
        gap = before_sync[slowest] - typical
        slow = before_sync[slowest] > (1 + STRAGGLER_MARGIN) * typical and gap >= max(
            STRAGGLER_MIN_MS, STRAGGLER_STEP_SHARE * step_ms)
        self._straggler_window.append((slowest if slow else None, rows))
        flagged = Counter(rank for rank, _ in self._straggler_window if rank is not None)
        if len(self._straggler_window) == STRAGGLER_WINDOW and flagged:
            rank, count = flagged.most_common(1)[0]
            if count >= STRAGGLER_MIN_FLAGGED:
                window = [r for _, r in self._straggler_window]
                means = {field: [sum(r[k][i] for r in window) / len(window) for k in range(len(rows))]
                         for i, field in enumerate(GATHER_FIELDS) if field != "step"}
                medians = [median(r[k][2] + r[k][3] for r in window) for k in range(len(rows))]
                mine = medians[rank]
                rest = sorted(medians[k] for k in range(len(rows)) if k != rank)
                typical_rest = rest[len(rest) // 2]
                self.record(Finding(
                    Kind.STRAGGLER_RANK, Severity.WARNING,
                    f"Rank {rank} is the slowest on {count} of the last {STRAGGLER_WINDOW} check steps: its data wait "
                    f"+ forward take {mine:.1f} ms (median) against {typical_rest:.1f} ms on the other ranks, which wait for "
                    "it in the gradient all-reduce (their backward phase is longer). Check that rank's data "
                    "(uneven sample sizes or a slow shard), its GPU (clocks, temperature, other processes) and its "
                    "CPU and data-loader workers.",
                    {"rank": rank, "flagged_check_steps": count, "window_check_steps": STRAGGLER_WINDOW,
                     "mean_ms_by_rank": means, "median_before_sync_ms_by_rank": medians,
                     "world_size": len(rows)}),
                    step, self._where, key=f"rank{rank}")
        self.close_episodes(step, self._where, {Kind.STRAGGLER_RANK})

    # --- profiler and sync-debug windows ----------------------------------------------------------
    def _window_boundary(self, step: int) -> bool:
        """Start or stop the profiler / sync-debug windows; True when a window closed (its cost is no data wait)."""
        closed = False
        if self.profile_window is not None:
            start, length = self.profile_window
            end = start + length
            if self._profiler is not None and step != self._profiler_step:
                self._profiler_step = step
                self._profiler.step()
                if step >= end:
                    self._stop_profiler()
                    closed = True
            elif self._profiler is None and not self._profile_done and max(start - 1, 0) <= step < end:
                self._start_profiler(step, start, end)
        if self.sync_window is not None and self.stopwatch.uses_cuda and not self._sync_done:
            start, length = self.sync_window
            if self._sync_catcher is None and start <= step < start + length:
                self._start_sync_window()
            elif self._sync_catcher is not None and step >= start + length:
                self._end_sync_window(step, self._where)
                closed = True
        return closed

    def _start_profiler(self, step: int, start: int, end: int) -> None:
        self._profile_done = True
        if not self.bound or self.session.output_dir is None:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = 1 if step < start else 0
        active = end - max(step + warmup, start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.stopwatch.uses_cuda else [])
        first, last = step + warmup, end - 1

        def on_trace_ready(profiler: Any) -> None:
            try:
                self._trace_ready(profiler, first, last)
            except Exception as failure:  # a full disk must not stop training
                self.warn(f"the torch.profiler trace of steps {first}-{last} could not be written "
                          f"({type(failure).__name__}: {failure}); training continues.")

        self._profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=active,
                                                                          repeat=1),
                                 on_trace_ready=on_trace_ready)
        self._profiler_step = step
        self._profiler.start()

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()

    def _trace_ready(self, profiler: Any, first: int, last: int) -> None:
        directory = self.session.output_dir / "profiler"  # type: ignore[operator]
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{self.rank}.steps{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        averages = profiler.key_averages()
        by_cpu = top_operators(averages, TOP_OPERATORS, by="self_cpu_ms")
        by_device = top_operators(averages, TOP_OPERATORS, by="self_device_ms") if self.stopwatch.uses_cuda else []
        trace = {"path": str(path), "first_step": first, "last_step": last,
                 "by_self_cpu": [dataclasses.asdict(row) for row in by_cpu],
                 "by_self_device": [dataclasses.asdict(row) for row in by_device],
                 "top_cpu": [row.name for row in by_cpu[:5]], "top_device": [row.name for row in by_device[:5]]}
        self.profiler_traces.append(trace)
        finding = Finding(
            Kind.PROFILER_TRACE, Severity.INFO,
            f"torch.profiler trace of steps {first}-{last} written to {path} (open it in Perfetto, "
            f"chrome://tracing or TensorBoard); top operators by self CPU time: {', '.join(trace['top_cpu'])}.",
            {"path": str(path), "first_step": first, "last_step": last, "top_cpu": trace["top_cpu"],
             "top_device": trace["top_device"]})
        self.emit(finding, last, self._where)

    def _start_sync_window(self) -> None:
        self._sync_previous_mode = torch.cuda.get_sync_debug_mode()
        self._sync_catcher = warnings.catch_warnings(record=True)
        self._sync_records = self._sync_catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def _end_sync_window(self, step: int, where: Where) -> None:
        if self._sync_catcher is None:
            return
        torch.cuda.set_sync_debug_mode(self._sync_previous_mode)
        self._sync_catcher.__exit__(None, None, None)
        self._sync_catcher = None
        self._sync_done = True
        records, self._sync_records = self._sync_records, []
        sites: Counter[tuple[str, int]] = Counter()
        for record in records:
            if "synchroniz" in str(record.message):
                sites[(record.filename, record.lineno)] += 1
            else:
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
        start, length = self.sync_window or (0, 0)
        self.sync_sites = []
        for (filename, lineno), count in sites.most_common(10):
            origin = ("lightning-debug" if filename.startswith(PACKAGE_DIR) else
                      "library" if "site-packages" in filename or "dist-packages" in filename else "user code")
            self.sync_sites.append({"file": filename, "line": lineno, "count": count, "origin": origin,
                                    "code": linecache.getline(filename, lineno).strip()})
        if not self.sync_sites:
            return
        user = [site for site in self.sync_sites if site["origin"] == "user code"]
        shown = (user or self.sync_sites)[:3]
        self.record(Finding(
            Kind.HOST_SYNC, Severity.WARNING if user else Severity.INFO,
            f"{sum(sites.values())} host-device synchronizations in steps {start}-{start + length - 1} "
            f"(torch.cuda.set_sync_debug_mode('warn')); "
            + "; ".join(f"{Path(s['file']).name}:{s['line']} `{s['code']}` x{s['count']}" for s in shown)
            + ". Each one stalls the CPU until the GPU catches up: keep values on the GPU (log tensors, not "
              ".item()), and avoid printing or branching on tensor values inside the step.",
            {"sites": self.sync_sites, "first_step": start, "last_step": start + length - 1}), step, where)

    # --- resume and report ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), stats={name: stats.state_dict() for name, stats in self.stats.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for name, state in state_dict.get("stats", {}).items():
            if name in self.stats:
                self.stats[name].load_state_dict(state)

    def report_section(self) -> dict[str, Any]:
        summaries = {name: self.stats[name].summary() for name in ("step", *PHASES)}
        stats = {f"{name}_time_ms": summary for name, summary in summaries.items()}
        for name in ("samples_per_sec", "tokens_per_sec"):
            if self.stats[name].count:
                stats[name] = self.stats[name].summary()
        clock = "CUDA events" if self.stopwatch.uses_cuda else "wall clock (perf_counter)"
        return dict(super().report_section(), stats=stats, clock=clock, loader=self.loader,
                    profiler_traces=list(self.profiler_traces), sync_sites=self.sync_sites,
                    excluded_steps=self.excluded_steps, dropped_measurements=self.dropped_measurements,
                    plugin_time_ms=self.own_stats.summary(), cpu_wait_ms=self.cpu_wait_stats.summary())
