"""The memory monitor's plumbing: events, readings, the census and allocation history; the rules live beside it."""

from __future__ import annotations

import dataclasses
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_debug.checks.memory import (
    MB,
    Census,
    MemoryPhase,
    MemoryReading,
    Trend,
    cuda_index,
    cuda_leak_sites,
    cuda_peak_and_reset,
    census_growth,
    describe_batch,
    graph_growth,
    heap_in_use,
    is_out_of_memory,
    oom_fixes,
    read_memory,
    take_census,
)
from lightning_debug.checks.timing import first_tensor
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.findings import Finding
from lightning_debug.core.guard import describe
from lightning_debug.core.kinds import Kind
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource
from lightning_debug.core.rules import CheckRead, Moment
from lightning_debug.core.session import Where
from lightning_debug.core.stats import RunningStats
from lightning_debug.core.verdicts import ConfirmedBy
from lightning_debug.monitors.memory.growth import (
    CARRIED_READINGS,
    GrowthSeries,
    growth_finding,
    growth_named,
    growth_status,
    growth_verdict,
    judge_growth,
    lasts_past,
)
from lightning_debug.monitors.memory.history import AllocationHistory, history_enabled, snapshot
from lightning_debug.monitors.memory.post_mortem import OomEvidence, fragmentation_share, oom_document, oom_finding
from lightning_debug.monitors.memory.settings import MemorySettings


@dataclass
class _Evidence:
    """The first census of a held ``memory_growth`` suspicion (the suspicion itself is the engine's, checkpointed)."""

    step: int
    census: Census
    history: bool


class MemoryMonitor(Monitor):
    """See :class:`lightning_debug.MemoryProfilerCallback`. Readings are taken before the optimizer step of check
    steps (like with like); other steps cost nothing, and phase boundaries are read only from ADVANCED on.
    """

    area = Area.MEMORY
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP,
                        Event.BATCH_END, Event.EVALUATION, Event.EXCEPTION})
    due_events = frozenset({Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END})

    def __init__(self, config: DebugConfig, source: str = "MemoryProfilerCallback") -> None:
        super().__init__(config, source)
        self.settings = MemorySettings.from_config(config)
        if not self.settings.phase_readings:  # the phase boundaries read nothing: the check and its input's size
            self.events = self.events - {Event.BEFORE_BACKWARD, Event.BATCH_END, Event.EVALUATION}
            self.due_events = self.due_events & self.events
        self.stats: dict[str, RunningStats] = {}
        self.phase_stats: dict[MemoryPhase, RunningStats] = {}
        self.census_ms = RunningStats()
        self.check_ms = RunningStats()
        self.windows = GrowthSeries(self.settings.window, self.settings.warmup_readings, self.settings.min_spacing)
        self.oom_files: list[str] = []
        self._device: torch.device | None = None
        self._evidence: _Evidence | None = None
        self._resumed = False  # the window came from a checkpoint: another process may have taken it
        self._waiting: tuple[Any, list[str]] | None = None  # a growth waiting for the end of its epoch
        self._released_epochs = 0  # epochs whose growth was released at their end
        self._carried: tuple[int, list[str]] | None = None  # growth kept past its epoch: (first step after, series)
        self.history = AllocationHistory(self.settings.history_entries)
        self._open_phase: MemoryPhase | None = None
        self._peak_since_check = 0
        self._heap_step: int | None = None
        self._elements: int | None = None
        self.unavailable: dict[str, str] = {}  # what this run cannot judge, and why (report.json ``unavailable``)

    @property
    def current_phase(self) -> MemoryPhase | None:
        """The phase of the step the run is in (None between batches or when not bound to a run)."""
        return self._ledger.phase if self._ledger is not None else None

    def start(self, step: int) -> None:
        """At EXPERT on CUDA, record the allocation history for the whole run: an OOM leaves a full snapshot."""
        device = self._device = self.context.device()
        self.unavailable = {}
        if self.context.epoch_end_step(step, {"epoch": 0, "batch": 0}) is None:
            self.unavailable["memory kept to an epoch's end"] = (
                "the epoch's length is unknown (with Accelerate: AccelerateDebugger(train_dataloader=loader); a loader "
                "without a length), so memory that a recipe keeps until the end of the epoch and releases there "
                "(outputs gathered for an epoch-level metric) is not told from a leak: `memory_growth` is judged "
                "without waiting for the epoch's end")
        if self.settings.whole_run_history and cuda_index(device) is not None and not history_enabled():
            self._start_history()
            self.warn("level=EXPERT records every CUDA allocation with its Python stack for the whole run "
                      "(a few microseconds per allocation) so that an OOM leaves a full memory snapshot.")

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self.phase(MemoryPhase.FORWARD, step)
        if self.due(step):  # the input's size, which the host's memory follows (see growth.INPUT_GROWTH)
            tensor = first_tensor(batch)
            self._elements = None if tensor is None else tensor.numel()

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self.phase(MemoryPhase.BACKWARD, step)

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        self.phase(MemoryPhase.OPTIMIZER, step)
        if self.due(step):
            self.measure(step, self.context.where(), self.context.device())
        return Decision.CONTINUE

    def batch_end(self, step: int, batch: Any) -> None:
        self.phase(None, step)

    def evaluation(self, step: int, started: bool) -> None:
        if started and self.current_phase is not MemoryPhase.VALIDATION:  # the run sets it after this event
            self.phase(MemoryPhase.VALIDATION, step)
        elif not started:
            self.phase(None, step)

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        self.post_mortem(error, step, self.context.where(), batch)

    def phase(self, phase: MemoryPhase | None, step: int | None = None) -> None:
        """``phase`` starts now (None: the current one ends); from ADVANCED, on check steps, read the CUDA peak of
        the phase that ends, or the CPU heap."""
        if not self.settings.phase_readings:
            return
        if step is not None and not self.due(step):
            self._open_phase = None
            return
        index = cuda_index(self._device)
        if index is not None:
            value = cuda_peak_and_reset(index)
            self._peak_since_check = max(self._peak_since_check, value)
        else:
            value = heap_in_use() or 0
        if self._open_phase is not None and value:
            self.phase_stats.setdefault(self._open_phase, RunningStats()).add(value / MB)
            if step is not None and self.settings.log_memory and self.bound:
                self.log_metrics(step, {f"debug/memory/phase/{self._open_phase.value}_mb": value / MB})
        self._open_phase = phase

    def measure(self, step: int, where: Where, device: torch.device | None) -> None:
        """Read memory, test ``memory_high`` and look for steady growth. The C heap (a glibc walk: up to
        milliseconds) and the DataLoader's workers are read only on the trend's readings, once per logging row and
        every ``min_spacing`` steps."""
        started = time.perf_counter()
        self._device = device
        spacing = min(self.settings.min_spacing, self.session.metrics.window if self.bound else 1)
        heap = (self._heap_step is None or not 0 <= step - self._heap_step < spacing or self.windows.takes(step))
        reading = read_memory(device, reset_peak=True, heap=heap, workers=heap)
        if reading.cpu_heap is not None:
            self._heap_step = step
        if reading.cuda_peak is not None:
            reading = dataclasses.replace(reading, cuda_peak=max(reading.cuda_peak, self._peak_since_check))
        self._peak_since_check = 0
        metrics = reading.metrics()
        for name, value in metrics.items():
            self.stats.setdefault(name, RunningStats()).add(value)
        if self.settings.log_memory:
            self.log_metrics(step, {f"debug/memory/{name}": value for name, value in metrics.items()})
        self.run_rules(Moment.CHECK_READ, CheckRead(step, reading, where, verdicts=self.verdicts,
                                                    settings=self.settings), step, where)
        if self.session.is_global_zero:
            self._check_growth(reading, step, where)
        self.close_episodes(step, where, self.kinds)
        self.check_ms.add((time.perf_counter() - started) * 1000)

    def _check_growth(self, reading: MemoryReading, step: int, where: Where) -> None:
        if self._evidence is None and self.verdicts.holding(Kind.MEMORY_GROWTH):  # held from before a resume
            self._evidence = self._gather(step, reading)
        if not self.windows.add(step, reading.leak_series(), self._elements, where.get("epoch")):
            named = growth_named(self.verdicts)
            if named is not None:
                self.record(named, step, where)
            return
        if self._resumed:
            self._resumed = False
            if self.windows.fell_back(self.windows.points):  # the process before ended, and its memory with it
                self._start_again(step)
                return
        if self._waiting is not None and where.get("epoch") != self._waiting[0]:
            _, series = self._waiting
            self._waiting = None
            if self.windows.fell_back(series):
                self._released_epochs += 1
                self._start_again(step)
                return
            self._carried = (step, series)
        if self._carried is None and self.verdicts.holding(Kind.MEMORY_GROWTH):
            boundary = self.windows.epoch_boundary()  # a suspicion across an epoch's end: does it keep its pace?
            if boundary is not None and self._paced_before_the_end(boundary, step):
                growing = list(self.windows.growing())
                self._carried = (boundary, growing) if growing else None
        if self._carried is not None:
            goes_on = self.windows.goes_on(self._carried[1], self._carried[0])
            if goes_on is None:
                return
            self._carried = None
            if not goes_on:  # it stopped with its epoch (a cache filled once)
                self._start_again(step)
                return
        growing = self.windows.growing()
        if growing and self.verdicts.holding(Kind.MEMORY_GROWTH):
            if self._evidence is not None and self._evidence.step == step:
                return  # its census was taken at this reading (after a resume): confirmed at a later one
            if self._waits_for_the_epoch(step, where, growing, reading):
                self._waiting = (where.get("epoch"), list(growing))
                return
        decided = judge_growth(step, growing, self.verdicts)
        if not growing:
            if self._evidence is not None:
                self._end_suspicion()
            return
        if decided is None:  # suspected: the census it is explained from, and the CUDA allocation history
            self._evidence = self._evidence or self._gather(step, reading)
            return
        if decided.by is ConfirmedBy.PERSISTED:  # the finding is kept with the held suspicion (and checkpointed)
            decided.latest.finding = self._explain(step, growing, reading)
        finding = decided.latest.finding
        assert finding is not None
        self.record(finding, step, where)

    def _gather(self, step: int, reading: MemoryReading) -> _Evidence:
        return _Evidence(step, self._census(), self._start_history() if reading.on_cuda else False)

    def _start_again(self, step: int) -> None:
        self.windows.restart()
        self.verdicts.observe(Kind.MEMORY_GROWTH, step)  # the suspicion held ends
        self._end_suspicion()

    def _waits_for_the_epoch(self, step: int, where: Where, growing: dict[str, Trend], reading: MemoryReading) -> bool:
        """Whether a confirmed growth waits for its epoch's end (outputs kept for an epoch-level metric): the window
        is within this epoch, memory lasts past its end, and another epoch follows (or an earlier one's growth was
        released at its end: the last epoch's ends with the run)."""
        epoch = where.get("epoch")
        if epoch is None or self.windows.one_epoch() != epoch:
            return False
        end = self.context.epoch_end_step(step, where)
        total, _ = self.context.schedule()
        if end is None or (total is not None and end >= total - 1 and not self._released_epochs):
            return False
        return lasts_past(step, end, growing, reading)

    def _paced_before_the_end(self, boundary: int, step: int) -> bool:
        """Whether the readings from ``boundary`` on that tell a growth's pace (``CARRIED_READINGS``) are taken by
        now or before the run ends: a leak is not left suspected at the end for want of them."""
        missing = CARRIED_READINGS - self.windows.readings_since(boundary)
        total, _ = self.context.schedule()
        spacing = max(self.settings.frequency, self.settings.min_spacing)
        return missing <= 0 or (total is not None and step + missing * spacing < total)

    def _growth_at_the_end(self, step: int, series: list[str]) -> None:
        """A growth of ``series`` that waited for its epoch's end when the run ended first (a one-pass Accelerate
        loop, whose number of steps is unknown; a run stopped early): released by now, as a loop that clears what it
        kept for the epoch does, or named."""
        self._waiting = None
        reading = read_memory(self._device, reset_peak=False, workers=True)
        if self.windows.fell_back(series, reading.leak_series()):
            return
        growing = {name: self.windows.trends[name] for name in series if name in self.windows.trends}
        if not growing or self._evidence is None:
            return
        decided = judge_growth(step, growing, self.verdicts)
        if decided is not None and decided.by is ConfirmedBy.PERSISTED:
            decided.latest.finding = self._explain(step, growing, reading)
            self.record(decided.latest.finding, step, self.context.where())

    def _last_reading(self, step: int) -> None:
        """The run's end is a reading too: a growth suspected at the last one is confirmed or dismissed by the memory
        as training ends (over the series read again), not left suspected for want of the next reading."""
        reading = read_memory(self._device, reset_peak=False, workers=True)
        values = reading.leak_series()
        if self.windows.fell_back(self.windows.growing(), values):  # released before the end: what an epoch keeps
            self.verdicts.observe(Kind.MEMORY_GROWTH, step)
            return
        if not self.windows.add(step, values, epoch=self.context.where().get("epoch"), last=True):
            return
        growing = {name: trend for name, trend in self.windows.growing().items() if name in values}
        decided = judge_growth(step, growing, self.verdicts)
        if decided is not None and decided.by is ConfirmedBy.PERSISTED:
            decided.latest.finding = self._explain(step, growing, reading)
            self.record(decided.latest.finding, step, self.context.where())

    def _census(self) -> Census:
        census = take_census()
        self.census_ms.add(census.seconds * 1000)
        return census

    def _start_history(self) -> bool:
        failure = self.history.start()
        if failure is not None:
            self.warn(f"could not record CUDA allocation history ({type(failure).__name__}: {failure}); "
                      "leaks are explained from the tensor census only.")
        return failure is None

    def _stop_history(self) -> None:
        if not self.settings.whole_run_history:
            self.history.stop()

    def _end_suspicion(self) -> None:
        self._evidence = None
        self._stop_history()

    def _dump_snapshot(self, snapshot: dict[str, Any], stem: str, step: int) -> str | None:
        path = self.session.file_path(stem, step, ".pickle")
        if path is None:
            return None
        with open(path, "wb") as handle:
            pickle.dump(snapshot, handle)
        return str(path)

    def _explain(self, step: int, growing: dict[str, Trend], reading: MemoryReading) -> Finding:
        suspicion = self._evidence
        assert suspicion is not None
        self._evidence = None
        steps = step - suspicion.step
        census = self._census()
        grown = census_growth(suspicion.census, census, steps)
        graphs = graph_growth(suspicion.census, census, steps)
        sites: list[dict[str, Any]] = []
        snapshot_path = None
        index = cuda_index(self._device)
        if suspicion.history and index is not None:
            try:
                allocations = snapshot()
                sites = cuda_leak_sites(allocations, index)
                snapshot_path = self._dump_snapshot(allocations, "memory_growth", step)
            finally:
                self._stop_history()
        return growth_finding(step, growing, self.windows.trends, reading, suspicion.step, grown, graphs, sites,
                              snapshot_path, self.census_ms.last)

    def growth_verdict(self) -> dict[str, Any]:
        """The report's ``growth`` entry: where the leak rule stands and the trends."""
        named = growth_named(self.verdicts)
        status = growth_status(self.verdicts, judged=self.windows.readings > self.windows.warmup_readings)
        return growth_verdict(status, self.windows.trends, named.message if named is not None else None)

    def post_mortem(self, exception: BaseException, step: int, where: Where, batch: object | None) -> None:
        """After an out-of-memory error: write ``oom_step<N>.md`` and an ``oom`` event (the caller re-raises)."""
        if not is_out_of_memory(exception):
            return
        index = cuda_index(self._device)
        if index is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
        reading = read_memory(torch.device("cuda", index) if index is not None else None, reset_peak=False)
        error = f"{type(exception).__name__}: {describe(exception)}"
        batch_lines = describe_batch(batch) if batch is not None else []
        largest = self._census().largest(10)
        fixes = oom_fixes(self.current_phase, fragmentation_share(reading))
        summary = snapshot_path = None
        if index is not None:
            summary = torch.cuda.memory_summary(index)
            if history_enabled():
                snapshot_path = self._dump_snapshot(snapshot(), "oom_snapshot", step)
        phase = self.current_phase.value if self.current_phase is not None else "outside a training step"
        evidence = OomEvidence(step, phase, error, reading, batch_lines, largest, fixes, summary)
        path = self.session.write_document("oom", step, oom_document(evidence, snapshot_path))
        if path is not None:
            self.oom_files.append(str(path))
        self.record(oom_finding(evidence, str(path) if path else None, snapshot_path), step, where, key=str(step))

    def finalize(self, step: int) -> None:
        if self._waiting is not None and self.session.is_global_zero:
            self._growth_at_the_end(step, self._waiting[1])
        elif self._evidence is not None and self.verdicts.holding(Kind.MEMORY_GROWTH) and self.session.is_global_zero:
            self._last_reading(step)
        self._evidence = None
        super().finalize(step)
        self.restore()

    def restore(self) -> None:
        self.history.stop()

    def state_dict(self) -> dict[str, Any]:
        waiting = None if self._waiting is None else [self._waiting[0], list(self._waiting[1])]
        carried = None if self._carried is None else [self._carried[0], list(self._carried[1])]
        return dict(super().state_dict(), stats={name: stats.state_dict() for name, stats in self.stats.items()},
                    growth={"window": self.windows.state_dict(), "waiting": waiting, "carried": carried,
                            "released_epochs": self._released_epochs})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for name, state in state_dict.get("stats", {}).items():
            self.stats.setdefault(name, RunningStats()).load_state_dict(state)
        growth = state_dict.get("growth")
        if growth is not None:
            self.windows.load_state_dict(growth["window"])
            waiting, carried = growth.get("waiting"), growth.get("carried")
            self._waiting = None if waiting is None else (waiting[0], list(waiting[1]))
            self._carried = None if carried is None else (int(carried[0]), list(carried[1]))
            self._released_epochs = int(growth.get("released_epochs", 0))
            self._resumed = bool(self.windows.points)

    def report_section(self) -> dict[str, Any]:
        return dict(
            super().report_section(),
            stats={f"memory/{name}": stats.summary() for name, stats in self.stats.items() if stats.count},
            growth=self.growth_verdict(),
            phases={phase.value: stats.summary() for phase, stats in self.phase_stats.items()},
            phase_reading="cuda_peak" if cuda_index(self._device) is not None else "cpu_heap",
            cost_ms={"check": self.check_ms.summary(), "census": self.census_ms.summary()},
            oom_post_mortems=list(self.oom_files),
            unavailable=dict(self.unavailable),
        )
