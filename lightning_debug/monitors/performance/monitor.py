"""Where each optimizer step's time goes and what stalls it: the plumbing, driven by the run's events at phase
boundaries (an integer comparison per boundary on other steps)."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from lightning_debug.checks.timing import (CpuWait, Mark, Phase, PhaseTimer, StepTimes, Stopwatch, first_tensor,
                                           infer_batch_size)
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.kinds import Kind
from lightning_debug.core.ledger import FrameworkWork
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where
from lightning_debug.monitors.performance.data_wait import DataWaitRule
from lightning_debug.monitors.performance.loader import describe_loader, usable_cpus
from lightning_debug.monitors.performance.profiler import StepWindows, host_sync_finding, trace_finding
from lightning_debug.monitors.performance.settings import PerformanceSettings
from lightning_debug.monitors.performance.slow_step import SlowStepRule
from lightning_debug.monitors.performance.step_stats import StepStats, step_metrics
from lightning_debug.monitors.performance.stragglers import GATHER_FIELDS, StragglerRule, gather_row, straggler_plan

PERF_KINDS = {Kind.SLOW_STEP, Kind.DATALOADER_BOTTLENECK}
MAX_PENDING = 16
SizeFn = Callable[[Any], int]


class PerformanceMonitor(Monitor):
    """Step-phase timing, throughput, slow steps, data-loader stalls, stragglers, torch.profiler.

    ``batch_size_fn`` / ``tokens_fn``: samples and tokens of a batch, when the first tensor's dimension 0 is not
    it. A plain loop drives it through a run::

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
    """

    area = Area.PERFORMANCE
    events = frozenset({Event.START, Event.EPOCH_START, Event.BATCH_START, Event.BEFORE_BACKWARD,
                        Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END, Event.EVALUATION})
    # the phases inside a step matter on timed steps only; a batch's start and end also hand a step's start over
    due_events = frozenset({Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP})

    def __init__(self, config: DebugConfig, source: str = "PerformanceProfilerCallback", *,
                 batch_size_fn: SizeFn | None = None, tokens_fn: SizeFn | None = None) -> None:
        super().__init__(config, source)
        self.settings = PerformanceSettings.from_config(config)
        self.batch_size_fn, self.tokens_fn = batch_size_fn, tokens_fn
        self.stopwatch = Stopwatch(None)
        self._cpu_wait = CpuWait()
        self.world_size, self.rank = 1, 0
        self.all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.loader: dict[str, Any] | None = None
        self.step_stats = StepStats()
        self.profile_window = self.settings.profile_window
        self.profiler_traces: list[dict[str, Any]] = []
        self.sync_sites: list[dict[str, Any]] | None = None
        self.excluded_steps = self.dropped_measurements = 0
        self.batch_end_collectives = functools.partial(straggler_plan, self)
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._timer: PhaseTimer | None = None
        self._next_start: tuple[int, Mark, float, float] | None = None
        self._pending: list[PhaseTimer] = []
        self._gathers: deque[Readback] = deque()
        self._latest: StepTimes | None = None
        self._where: Where = {"epoch": 0, "batch": 0}
        self.slow_steps, self.data_wait, self.stragglers = SlowStepRule(self.verdicts), DataWaitRule(), StragglerRule()
        output_dir = self.session.output_dir if self.bound else None
        self.windows = StepWindows(self.settings, self.stopwatch.uses_cuda, self.rank, output_dir,
                                   self._trace_written, self._sync_window_closed, self.warn,
                                   in_use=self.context.profiler_in_use if self.bound else None)

    # --- events ---------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Start (or restart) timing a run on the context's device, processes and loader."""
        context = self.context
        self.ledger.timing = self.schedule
        self.session.own_time.enabled = True  # the run counts its own time from now on, and phases leave it out
        self.stopwatch.cpu_wait_ms = None
        self._cpu_wait.close()
        stopwatch = Stopwatch(context.device(), self.session.own_time.total_ms)
        if not stopwatch.uses_cuda:  # the host's wait for a CPU says nothing of the GPU's timeline
            stopwatch.cpu_wait_ms = self._cpu_wait
        self.stopwatch = stopwatch
        self.world_size, self.rank = context.world_size, context.rank
        self.all_gather = context.all_gather()
        loader = context.train_loader()
        if loader is not None:
            self.loader = describe_loader(loader)
        self._reset_run_state()

    def epoch_start(self, step: int) -> None:
        self.loader = describe_loader(self.context.train_loader())
        self.reset_data_clock(step)
        self.ledger.forget_notes(step)  # the last epoch's validation and checkpoint ran before the clock restarted

    def evaluation(self, step: int, started: bool) -> None:
        if not started:
            self.reset_data_clock(step)

    def reset_data_clock(self, step: int) -> None:
        """Time spent outside training steps (validation, epoch boundaries) is no data wait: restart the clock."""
        timer = self._timer
        if timer is not None and timer.current is Phase.DATA:
            timer.restart()
        elif self.due(step):
            self._next_start = (step, self.stopwatch.mark(), self.stopwatch.own(), self.stopwatch.cpu_wait())

    # --- phase boundaries -----------------------------------------------------------------------
    def batch_start(self, step: int, batch: Any, captured: Any = None) -> None:
        """A batch of optimizer step ``step`` starts; the data wait ends here."""
        if step <= self.windows.until and self.windows.boundary(step):
            self.reset_data_clock(step)
        if not self.schedule.is_due(step):
            return
        timer = self._timer
        if timer is not None and timer.step != step:
            self._complete(timer)
            timer = None
        if timer is None:
            start, start_own, start_wait = (self._next_start[1:] if self._next_start is not None and
                                            self._next_start[0] == step else (None, None, None))
            timer = self._timer = PhaseTimer(self.stopwatch, step, start, start_own, start_wait)
            self._next_start = None
        timer.enter(Phase.FORWARD)
        timer.excluded = timer.excluded or self.windows.active
        tensor = first_tensor(batch)  # found once: the batch size and the input's elements are both read from it
        samples = self.batch_size_fn(batch) if self.batch_size_fn is not None else infer_batch_size(tensor)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else None
        timer.add_samples(None if samples is None else int(samples), None if tokens is None else int(tokens),
                          None if tensor is None else tensor.numel())

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        if self._timer is not None:
            self._timer.enter(Phase.BACKWARD)

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        if self._timer is not None:
            self._timer.enter(Phase.OPTIMIZER)
        return Decision.CONTINUE

    def batch_end(self, step: int, batch: Any) -> None:
        """A batch of optimizer step ``step`` ends. On a check step the ranks gather their step times whatever
        failed here (a failure sends NaN, then raises)."""
        failure: Exception | None = None
        try:
            self._end_batch(step)
        except Exception as error:
            failure = error
        if self.session.gate.due("stragglers"):  # planned by the run (straggler_plan), made whatever failed here
            self._gather(failed=failure is not None)
        if failure is not None:
            raise failure

    def _end_batch(self, step: int) -> None:
        timer = self._timer
        handed_over = False
        if timer is not None:
            if timer.step == step:
                end = timer.stop()
                timer.where = dict(self.context.where())
                if timer.saw_optimizer:
                    self._complete(timer)
                    if self.due(step + 1):
                        self._next_start, handed_over = (step + 1, end, timer.since_own, timer.since_wait), True
            else:
                self._complete(timer)
        if self._timer is None and not handed_over and self.due(step + 1):
            self._next_start = (step + 1, self.stopwatch.mark(), self.stopwatch.own(), self.stopwatch.cpu_wait())
        if self._pending or self._gathers:
            self._where = dict(self.context.where())
            self._poll()

    def finalize(self, step: int) -> None:
        """The end of the run (or an exception): read what is left, stop the profiler, close episodes."""
        where = self._where = dict(self.context.where())
        timer = self._timer
        if timer is not None and timer.last_stop is not None and timer.saw_optimizer:
            self._complete(timer)
        self._timer = None
        for pending in self._pending:
            try:
                pending.wait()
            except Exception:  # a failed CUDA context must not hide the run's own error
                pending.excluded = True
        self._poll(final=True)
        held = self.slow_steps.flush()
        if held is not None:
            self.record(held.finding(), held.step, where, key=held.key)
        self.windows.stop_profiler()
        self.windows.not_reached(step)
        self._where = where  # the sync-debug window's finding, if still open, is placed where the run ended
        self.windows.end_sync_window(step)
        super().finalize(step)

    def restore(self) -> None:
        self._cpu_wait.close()
        self.windows.restore()

    # --- measurements -----------------------------------------------------------------------------
    def _complete(self, timer: PhaseTimer) -> None:
        if self._timer is timer:
            self._timer = None
        if timer.last_stop is not None:
            self._pending.append(timer)
            if len(self._pending) > MAX_PENDING:
                self._pending.pop(0)
                self.dropped_measurements += 1
        self._where = dict(timer.where) or self._where
        self._poll()

    def _poll(self, final: bool = False) -> None:
        while self._pending and self._pending[0].ready():
            self._process(self._pending.pop(0))
        if final:
            self._pending.clear()
        while self._gathers and (final or self._gathers[0].ready()):
            readback = self._gathers.popleft()
            try:
                values = readback.values()
            except Exception:
                continue
            gathered = self.stragglers.judge(values)
            if gathered is None:
                continue
            if gathered.straggler is not None:
                straggler = gathered.straggler
                self.record(straggler.finding(), gathered.step, self._where, key=straggler.key)
            self.close_episodes(gathered.step, self._where, {Kind.STRAGGLER_RANK})

    def _gather(self, failed: bool = False) -> None:
        row = None if failed else lambda: torch.tensor(gather_row(self._latest), dtype=torch.float64)
        gathered = self.session.gate.rows("stragglers", row, len(GATHER_FIELDS), self.stopwatch.device,
                                          self.all_gather)  # a row of NaN: nobody judges it
        self._gathers.append(Readback(gathered.reshape(-1), blocking=False))
        self._poll()

    def _process(self, timer: PhaseTimer) -> None:
        if timer.excluded or self.ledger.was_instrumented(timer.step):
            self.excluded_steps += 1
            return
        times, where = timer.read(), timer.where or self._where
        self.step_stats.add(times, self.world_size, cpu_waits_read=self.stopwatch.cpu_wait_ms is not None)
        if self.settings.log_performance:
            self.log_metrics(times.step, step_metrics(times, self.world_size))
        slow = self.slow_steps.judge(times, self.settings)
        if slow is not None:
            if self.ledger.notes_hooks and slow.recurring:
                slow = replace(slow, hooks=self.ledger.noted(self.slow_steps.recent_outliers()))
            if slow.phase is Phase.DATA and (where or {}).get("batch") == 0:
                slow = replace(slow, epoch_start=True, loader=self.loader)
            self.record(slow.finding(), slow.step, where, key=slow.key)
        # a checkpoint saved between two batches blocks in this step's data wait: a slow step, not the loader's
        saved = self.ledger.notes_hooks and self.ledger.ran(times.step, FrameworkWork.CHECKPOINT_SAVING)
        waiting = None if saved else self.data_wait.judge(times, self.settings, (where or {}).get("batch") == 0)
        if waiting is not None:
            self.record(waiting.finding(self.loader, self.stopwatch.uses_cuda, usable_cpus()), times.step, where)
        ongoing = self.slow_steps.ongoing(times.step)  # a periodic stall between two recurrences: one episode
        self.close_episodes(times.step, where, PERF_KINDS - {Kind.SLOW_STEP} if ongoing else PERF_KINDS)
        self.slow_steps.remember(times)
        self._latest = times

    def _unavailable(self) -> dict[str, str]:
        """What the run cannot judge, and why (report.json ``unavailable``, report.md's "Not judged")."""
        if self.loader is not None:
            return {}
        return {"loader settings": "no training DataLoader was given (with Accelerate: AccelerateDebugger("
                                   "train_dataloader=loader)) or the loader has no num_workers, so "
                                   "`dataloader_bottleneck` is still found from the step times but cannot say which "
                                   "of num_workers, pin_memory, persistent_workers to change, and a slow first batch "
                                   "of an epoch is not traced to the loader's workers"}

    # --- what the windows found -------------------------------------------------------------------
    def _trace_written(self, trace: dict[str, Any]) -> None:
        self.profiler_traces.append(trace)
        self.emit(trace_finding(trace), trace["last_step"], self._where)

    def _sync_window_closed(self, sites: list[dict[str, Any]], total: int, step: int) -> None:
        self.sync_sites = sites
        finding = host_sync_finding(sites, total, self.settings.sync_window or (0, 0))
        if finding is not None:
            self.record(finding, step, self._where)

    # --- resume and report ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), stats=self.step_stats.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.step_stats.load_state_dict(state_dict.get("stats", {}))

    def report_section(self) -> dict[str, Any]:
        clock = "CUDA events" if self.stopwatch.uses_cuda else "wall clock (perf_counter)"
        window = self.windows.outcome
        return dict(super().report_section(), stats=self.step_stats.summaries(), clock=clock, loader=self.loader,
                    unavailable=self._unavailable(), profiler_traces=list(self.profiler_traces),
                    profiler_window=None if window is None else dict(window, status=window["status"].value),
                    sync_sites=self.sync_sites,
                    excluded_steps=self.excluded_steps, dropped_measurements=self.dropped_measurements,
                    plugin_time_ms=self.step_stats.own.summary(), cpu_wait_ms=self.step_stats.cpu_wait.summary())
