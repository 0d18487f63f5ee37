"""Memory over the run: readings, ``memory_high``, leaks found and explained, the OOM post-mortem.

Framework-free: the run drives it through the same events in a Lightning callback, an Accelerate
loop or a plain training loop::

    >>> from lightning_debug import DebugConfig
    >>> from lightning_debug.core.monitor import RunContext
    >>> from lightning_debug.run import Run
    >>> from lightning_debug.monitors.memory import MemoryMonitor
    >>> monitor = MemoryMonitor(DebugConfig(memory_profiling_frequency=5), "my_loop")
    >>> run = Run(DebugConfig(save_debug_info=False), RunContext(), [monitor])
    >>> run.start(0)
    >>> for step in range(20):
    ...     _ = run.before_optimizer_step(step, None)
    >>> run.finalize(19)
    >>> monitor.report_section()["stats"]["memory/cpu_rss_mb"]["count"]
    4
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from lightning_debug.checks.memory import (
    MB,
    SERIES_LABELS,
    Census,
    MemoryReading,
    Trend,
    cuda_index,
    cuda_leak_sites,
    cuda_peak_and_reset,
    census_growth,
    describe_batch,
    explain_growth,
    fit_trend,
    format_bytes,
    graph_growth,
    heap_in_use,
    is_out_of_memory,
    is_steady_growth,
    oom_fixes,
    read_memory,
    steps_until_exhausted,
    take_census,
)
from lightning_debug.config import Area, DebugConfig, DebugLevel
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource
from lightning_debug.core.session import Where
from lightning_debug.core.stats import RunningStats

# Below these rises over the trend window, growth is allocator granularity or warm-up creep.
GROWTH_FLOORS = {"cuda_allocated": 1.0 * MB, "cpu_heap": 1.0 * MB, "cpu_rss": 32.0 * MB}


def _history_enabled() -> bool:
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


@dataclass
class _Suspicion:
    step: int
    census: Census
    history: bool


class MemoryMonitor(Monitor):
    """See :class:`lightning_debug.MemoryProfilerCallback` for the behaviour users rely on.

    The phase of the step is followed through the events (forward from a batch's start, backward,
    optimizer, evaluation); on check steps the readings are taken before the optimizer step, at
    the same point of every such step; an out-of-memory exception gets a post-mortem.
    """

    area = Area.MEMORY
    kinds = frozenset({Kind.MEMORY_HIGH, Kind.MEMORY_GROWTH})  # an ``oom`` is one event, never an open episode
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP,
                        Event.BATCH_END, Event.EVALUATION, Event.EXCEPTION})
    frequency_field = "memory_profiling_frequency"
    window = 32
    warmup_readings = 2
    min_spacing = 8
    history_entries = 100_000

    def __init__(self, config: DebugConfig, source: str = "MemoryProfilerCallback") -> None:
        super().__init__(config, source)
        self.stats: dict[str, RunningStats] = {}
        self.phase_stats: dict[str, RunningStats] = {}
        self.census_ms = RunningStats()
        self.check_ms = RunningStats()
        self.series: dict[str, deque[tuple[int, float]]] = {}
        self.trends: dict[str, Trend] = {}
        self.readings = 0
        self.current_phase: str | None = None
        self.verdict: dict[str, Any] = {"status": "not enough readings"}
        self.oom_files: list[str] = []
        self._device: torch.device | None = None
        self._suspicion: _Suspicion | None = None
        self._growth: Finding | None = None
        self._history_ours = False
        self._open_phase: str | None = None
        self._peak_since_check = 0
        self._advanced = config.level >= DebugLevel.ADVANCED
        self._step_in_progress = 0

    # --- events ---------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Learn which device trains. At EXPERT level on CUDA this switches on allocation history for
        the whole run, so an OOM leaves a full snapshot."""
        device = self._device = self.context.device()
        if self.config.level >= DebugLevel.EXPERT and cuda_index(device) is not None and not _history_enabled():
            self._start_history()
            self.warn("level=EXPERT records every CUDA allocation with its Python stack for the whole run "
                      "(a few microseconds per allocation) so that an OOM leaves a full memory snapshot.")

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self._step_in_progress = step
        self.phase("forward", step)

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self.phase("backward", step)

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        self.phase("optimizer", step)
        if self.due(step):
            self.measure(step, self.context.where(), self.context.device())
        return Decision.CONTINUE

    def batch_end(self, step: int, batch: Any) -> None:
        self.phase("end", self._step_in_progress)

    def evaluation(self, step: int, started: bool) -> None:
        if started and self.current_phase != "validation":
            self.phase("validation", step)
        elif not started:
            self.phase("end", step)

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        self.post_mortem(error, step, self.context.where(), batch)

    def phase(self, name: str, step: int | None = None) -> None:
        """Mark that phase ``name`` ("forward", "backward", "optimizer", "validation"; "end" closes the
        current one) starts now.

        Remembering the name costs nothing and tells the OOM post-mortem where the run was. From
        ADVANCED level on, on check steps (every call when ``step`` is None), it also reads host-side
        counters: on CUDA the peak allocated during the phase that ends, on the CPU the heap in use
        when it ends.
        """
        self.current_phase = None if name == "end" else name
        if not self._advanced:
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
            if step is not None and self.config.log_memory and self.bound:
                self.log_metrics(step, {f"debug/memory/phase/{self._open_phase}_mb": value / MB})
        self._open_phase = self.current_phase

    # --- the check step -----------------------------------------------------------------------------
    def measure(self, step: int, where: Where, device: torch.device | None) -> None:
        """Read memory (scalars), test ``memory_high`` and look for steady growth.

        Call at the same point of every check step so that readings compare like with like.
        """
        started = time.perf_counter()
        self._device = device
        reading = read_memory(device, reset_peak=True)
        if reading.cuda_peak is not None:
            reading = dataclasses.replace(reading, cuda_peak=max(reading.cuda_peak, self._peak_since_check))
        self._peak_since_check = 0
        metrics = reading.metrics()
        for name, value in metrics.items():
            self.stats.setdefault(name, RunningStats()).add(value)
        if self.config.log_memory:
            self.log_metrics(step, {f"debug/memory/{name}": value for name, value in metrics.items()})
        self._check_high(reading, step, where)
        if self.session.is_global_zero:
            self._check_growth(reading, step, where)
        self.close_episodes(step, where, self.kinds)
        self.check_ms.add((time.perf_counter() - started) * 1000)

    def _check_high(self, reading: MemoryReading, step: int, where: Where) -> None:
        limit = self.config.memory_high_fraction
        if reading.cuda_reserved is not None and reading.cuda_total:
            share = reading.cuda_reserved / reading.cuda_total
            if share > limit:
                self.record(Finding(
                    Kind.MEMORY_HIGH, Severity.WARNING,
                    f"CUDA memory reserved is {share:.0%} of the device ({format_bytes(reading.cuda_reserved)} of "
                    f"{format_bytes(reading.cuda_total)}; {format_bytes(reading.cuda_allocated or 0)} allocated) at "
                    f"step {step}, above memory_high_fraction={limit:g}: a larger batch or a longer sequence will "
                    "run out. Mixed precision, activation checkpointing or a smaller batch make room.",
                    {"device": "cuda", "fraction": share, "reserved_mb": reading.cuda_reserved / MB,
                     "allocated_mb": (reading.cuda_allocated or 0) / MB, "total_mb": reading.cuda_total / MB,
                     "limit": limit}), step, where, key="cuda")
        used = 1.0 - reading.cpu_available / reading.cpu_total if reading.cpu_total else 0.0
        if used > limit:
            self.record(Finding(
                Kind.MEMORY_HIGH, Severity.WARNING,
                f"System memory is {used:.0%} used ({format_bytes(reading.cpu_available)} available of "
                f"{format_bytes(reading.cpu_total)}; this process holds {format_bytes(reading.cpu_rss)}) at step "
                f"{step}, above memory_high_fraction={limit:g}: the machine may start swapping or the OOM killer "
                "may end the run. Fewer DataLoader workers, a smaller prefetch_factor or a dataset read from "
                "disk instead of memory make room.",
                {"device": "cpu", "fraction": used, "available_mb": reading.cpu_available / MB,
                 "total_mb": reading.cpu_total / MB, "rss_mb": reading.cpu_rss / MB, "limit": limit}),
                step, where, key="cpu")

    # --- leaks ----------------------------------------------------------------------------------------
    def _check_growth(self, reading: MemoryReading, step: int, where: Where) -> None:
        self.readings += 1
        latest = self.series["cpu_rss"][-1][0] if self.series.get("cpu_rss") else None
        if self.readings <= self.warmup_readings or (latest is not None and step - latest < self.min_spacing):
            if self._growth is not None:
                self.record(self._growth, step, where)
            return
        for name, value in reading.leak_series().items():
            self.series.setdefault(name, deque(maxlen=self.window)).append((step, value))
        self.trends = {name: trend for name, points in self.series.items() if (trend := fit_trend(list(points)))}
        growing = {name: trend for name, trend in self.trends.items()
                   if is_steady_growth(trend, GROWTH_FLOORS[name])}
        if not growing:
            if self._suspicion is not None:
                self._end_suspicion()
            self._growth = None
            self.verdict = self._verdict("no steady growth")
            return
        if self._growth is not None:
            self.record(self._growth, step, where)
            self.verdict = self._verdict("growing")
            return
        if self._suspicion is None:
            self._suspicion = _Suspicion(step, self._census(), self._start_history() if reading.on_cuda else False)
            self.verdict = self._verdict("suspected")
            return
        self._growth = self._explain(step, growing, reading)
        self.record(self._growth, step, where)
        self.verdict = self._verdict("growing")

    def _census(self) -> Census:
        census = take_census()
        self.census_ms.add(census.seconds * 1000)
        return census

    def _start_history(self) -> bool:
        if _history_enabled():
            return True
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=self.history_entries, clear_history=True)
        except Exception as failure:
            self.warn(f"could not record CUDA allocation history ({type(failure).__name__}: {failure}); "
                      "leaks are explained from the tensor census only.")
            return False
        self._history_ours = True
        return True

    def _stop_history(self) -> None:
        if self._history_ours and self.config.level < DebugLevel.EXPERT:
            self._history_ours = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def _end_suspicion(self) -> None:
        self._suspicion = None
        self._stop_history()

    def _dump_snapshot(self, snapshot: dict[str, Any], stem: str, step: int) -> str | None:
        path = self.session.file_path(stem, step, ".pickle")
        if path is None:
            return None
        with open(path, "wb") as handle:
            pickle.dump(snapshot, handle)
        return str(path)

    def _explain(self, step: int, growing: dict[str, Trend], reading: MemoryReading) -> Finding:
        suspicion = self._suspicion
        assert suspicion is not None
        self._suspicion = None
        steps = step - suspicion.step
        census = self._census()
        grown = census_growth(suspicion.census, census, steps)
        graphs = graph_growth(suspicion.census, census, steps)
        sites: list[dict[str, Any]] = []
        snapshot_path = None
        index = cuda_index(self._device)
        if suspicion.history and index is not None:
            try:
                snapshot = torch.cuda.memory._snapshot()
                sites = cuda_leak_sites(snapshot, index)
                snapshot_path = self._dump_snapshot(snapshot, "memory_growth", step)
            finally:
                self._stop_history()
        name = next(iter(growing))
        trend = growing[name]
        if name == "cuda_allocated":
            headroom, what = (reading.cuda_total or 0) - (reading.cuda_allocated or 0), "this GPU"
        else:
            headroom, what = reading.cpu_available, "this machine's available memory"
        remaining = steps_until_exhausted(trend.slope, headroom)
        run_out_step = step + int(remaining) if math.isfinite(remaining) else None
        where_text = ""
        if sites:
            where_text = " Allocation sites still holding memory: " + "; ".join(
                f"{site['site']} ({site['alive']} live, {site['alive_mb']:.1f} MB)" for site in sites[:3]) + "."
        rate = (f"Memory grows steadily: {SERIES_LABELS[name]} +{format_bytes(trend.slope)}/step over steps "
                f"{trend.first_step}-{trend.last_step} ({trend.readings} readings)")
        if run_out_step is not None:
            rate += f"; at this rate {what} ({format_bytes(headroom)} left) runs out around step {run_out_step:,}"
        message = f"{rate}. {explain_growth(grown, steps, graphs)}{where_text}"
        details = {
            "series": name, "mb_per_step": trend.slope / MB, "run_out_step": run_out_step,
            "headroom_mb": headroom / MB,
            "trends": {series: self.trends[series].summary() for series in growing},
            "tensors": [group.to_dict() for group in grown[:5]],
            "growing_graphs": [graph.to_dict() for graph in graphs[:3]],
            "census_steps": [suspicion.step, step], "census_ms": round(self.census_ms.last, 1),
            "cuda_sites": sites, "snapshot": snapshot_path,
        }
        return Finding(Kind.MEMORY_GROWTH, Severity.WARNING, message, details)

    def _verdict(self, status: str) -> dict[str, Any]:
        verdict: dict[str, Any] = {"status": status, "trends": {
            name: dict(trend.summary(), significant=is_steady_growth(trend, GROWTH_FLOORS[name]))
            for name, trend in self.trends.items()}}
        if self._growth is not None:
            verdict["message"] = self._growth.message
        return verdict

    # --- out of memory ---------------------------------------------------------------------------------
    def post_mortem(self, exception: BaseException, step: int, where: Where, batch: object | None) -> None:
        """After an out-of-memory error (anything else is ignored): write ``oom_step<N>.md`` and an
        ``oom`` event. Reads only; the caller re-raises ``exception`` unchanged."""
        if not is_out_of_memory(exception):
            return
        index = cuda_index(self._device)
        if index is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
        reading = read_memory(torch.device("cuda", index) if index is not None else None, reset_peak=False)
        error = f"{type(exception).__name__}: {exception}"
        batch_lines = describe_batch(batch) if batch is not None else []
        census = self._census()
        largest = census.largest(10)
        fragmentation = 0.0
        if reading.cuda_reserved is not None and reading.cuda_total:
            fragmentation = (reading.cuda_reserved - (reading.cuda_allocated or 0)) / reading.cuda_total
        fixes = oom_fixes(self.current_phase, fragmentation)
        summary = snapshot_path = None
        if index is not None:
            summary = torch.cuda.memory_summary(index)
            if _history_enabled():
                snapshot_path = self._dump_snapshot(torch.cuda.memory._snapshot(), "oom_snapshot", step)
        phase = self.current_phase or "outside a training step"
        path = self.session.write_document("oom", step, {
            "document": "oom_post_mortem", "step": step, "phase": phase, "error": error,
            "memory_mb": reading.metrics(), "batch": batch_lines, "largest_tensors": largest, "fixes": fixes,
            "cuda_memory_summary": summary, "snapshot": snapshot_path})
        if path is not None:
            self.oom_files.append(str(path))
        message = (f"Out of memory at step {step} during {phase} ({error.splitlines()[0][:300]})."
                   + (f" Post-mortem: {path}." if path else "") + " " + " ".join(fixes[:-4])
                   + " Try: a smaller batch, gradient accumulation (accumulate_grad_batches), mixed precision "
                   "(precision='bf16-mixed'), activation checkpointing.")
        self.record(Finding(Kind.OOM, Severity.CRITICAL, message, {
            "phase": phase, "error": error[:2000], "post_mortem": str(path) if path else None,
            "snapshot": snapshot_path, "batch": batch_lines, "largest_tensors": largest[:5],
            "memory_mb": reading.metrics(), "fixes": fixes}), step, where, key=str(step))

    # --- the end ---------------------------------------------------------------------------------------
    def finalize(self, step: int) -> None:
        """Close open episodes and stop the allocation history this monitor started."""
        self._suspicion = None
        super().finalize(step)
        self.restore()

    def restore(self) -> None:
        if self._history_ours:
            self._history_ours = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), stats={name: stats.state_dict() for name, stats in self.stats.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for name, state in state_dict.get("stats", {}).items():
            self.stats.setdefault(name, RunningStats()).load_state_dict(state)

    def report_section(self) -> dict[str, Any]:
        return dict(
            super().report_section(),
            stats={f"memory/{name}": stats.summary() for name, stats in self.stats.items() if stats.count},
            growth=self.verdict,
            phases={name: stats.summary() for name, stats in self.phase_stats.items()},
            phase_reading="cuda_peak" if cuda_index(self._device) is not None else "cpu_heap",
            cost_ms={"check": self.check_ms.summary(), "census": self.census_ms.summary()},
            oom_post_mortems=list(self.oom_files),
        )
