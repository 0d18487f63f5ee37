"""The one orchestrator: a training run's monitors, their shared measurements, and its lifecycle.

A :class:`Run` knows nothing of Lightning or Accelerate: an adapter gives it a
:class:`~lightning_debug.core.context.RunContext` and turns its hooks into the run's events (docs/architecture.md).
A failure inside a monitor is recorded once and the others go on; only :class:`~lightning_debug.AnomalyError`
leaves the run.

Example, a plain loop with the anomaly checks::

    >>> import torch
    >>> from lightning_debug import DebugConfig
    >>> from lightning_debug.core.monitor import RunContext
    >>> from lightning_debug.monitors.anomaly import AnomalyMonitor
    >>> config = DebugConfig(save_debug_info=False, print_summary=False)
    >>> model = torch.nn.Linear(2, 1); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> class Loop(RunContext):
    ...     def module(self): return model
    >>> run = Run(config, Loop(), [AnomalyMonitor(config, "my_loop")])
    >>> run.start(0)
    >>> for step in range(3):
    ...     run.batch_start(step, None)
    ...     loss = model(torch.ones(4, 2)).pow(2).mean() + (torch.log(torch.zeros(())) if step == 1 else 0)
    ...     run.before_backward(step, loss); loss.backward()
    ...     decision = run.before_optimizer_step(step, optimizer); optimizer.step(); optimizer.zero_grad()
    ...     run.after_optimizer_step(step + 1); run.batch_end()
    >>> report = run.finish(RunStatus.FINISHED, 3)
    >>> report["findings"]["nonfinite_loss"]["first_step"]
    1
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from lightning_debug.checks.memory.readings import MemoryPhase
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.context import RunContext, RunStatus
from lightning_debug.core.gate import bounded_wait, drop_gradients, gather_failures, merge_failures
from lightning_debug.core.guard import Failures, route
from lightning_debug.core.ledger import RunLedger
from lightning_debug.core.monitor import GATED_EVENTS, Decision, Event, Monitor
from lightning_debug.core.session import Session
from lightning_debug.core.numerics import NumericsQueue, StepNumerics
from lightning_debug.monitors.areas import coverage
from lightning_debug.report.attach import attach_files
from lightning_debug.report.document import build_report, moment, write_document, write_report
from lightning_debug.report.summary import FindingWarnings, conclude_run
from lightning_debug.report.tensorboard import attach_to_writer

AREA_ORDER = list(Area)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _own_time(method: _Method) -> _Method:
    """An event's entry: the plugin's own time (left out of step timing), and a failure in it one failed check
    (``Run.<event>``), never the adapter's; the gate closes the event's collectives whatever failed."""
    @functools.wraps(method)
    def counted(self: Run, *args: Any, **kwargs: Any) -> Any:
        return self.session.own_time.call(self.failures.call, f"Run.{method.__name__}", method, self, *args, **kwargs)
    return counted  # type: ignore[return-value]


def own_step(context: RunContext, ledger: RunLedger, counts: dict[int, int], optimizer: Any) -> int | None:
    """With several optimizers, how many steps ``optimizer`` took before this one (its index and count go into the
    ledger's record); None with one, or with sharded flat parameters (their optimizers hold copies)."""
    optimizers = context.optimizers()
    several = len(optimizers) > 1
    if not several or optimizer is None or context.grads_sharded:
        record = ledger.record
        if record.several_optimizers is not several or record.optimizer_index is not None \
                or record.optimizer_step is not None:
            ledger.record = record.moved(several_optimizers=several, optimizer_index=None, optimizer_step=None)
        return None
    own = counts.get(id(optimizer), 0)
    counts[id(optimizer)] = own + 1
    index = next((i for i, o in enumerate(optimizers) if o is optimizer), None)
    ledger.record = ledger.record.moved(several_optimizers=True, optimizer_index=index, optimizer_step=own)
    return own


class Run:
    """One training run: ``config`` holds the run-wide settings (each monitor keeps its own), ``context`` what the
    framework tells it; more ``monitors`` can be added before :meth:`start`."""

    def __init__(self, config: DebugConfig, context: RunContext, monitors: Iterable[Monitor] = ()) -> None:
        self.config = config
        self.context = context
        self.began = time.time()
        """When the run began (before any of its scalars): with its end, the span of its TensorBoard points."""
        self.failures = Failures()
        self.ledger = RunLedger()
        context.ledger = self.ledger
        self.numerics = NumericsQueue(ledger=self.ledger)
        output_dir = context.output_dir if config.save_debug_info else None
        self.logs_on_rows = context.logs_rows and config.follow_log_cadence
        if config.save_debug_info and context.output_problem and context.is_global_zero:
            self.failures.record("choosing the output directory", OSError(context.output_problem),
                                 "this run writes no files (events.jsonl, report); the checks and the console go on")
        self.session = Session(
            output_dir, context.is_global_zero,
            self.failures.call("logger", context.metrics_sink) if context.is_global_zero else None,
            self.failures, context.rank, run_id=context.run_id,
            log_every_n_steps=context.log_every_n_steps if config.follow_log_cadence else None,
            exposed=self.failures.call("callback metrics", context.exposed_metrics_sink)
            if config.expose_callback_metrics else None,
            rows=self.logs_on_rows)
        self.session.document_writer = write_document
        self.gate = self.session.gate  # every collective of the plugin: see lightning_debug.core.gate
        self.numerics.flags_sum = lambda flags: self.gate.sum("scan", lambda: flags, flags.numel(), flags.device)[0]
        printer = self.failures.call("console", context.console_printer)
        self._unroute = route(printer) if printer is not None else None
        if context.is_global_zero:
            self.session.event_listeners.append(FindingWarnings())
        self.monitors: list[Monitor] = []
        # (label, handler, every, monitor): a handler of a monitor's ``due_events`` runs on steps ``every`` divides
        self._handlers: dict[Event, list[tuple[str, Callable[..., Any], int, Monitor]]] = {event: [] for event in Event}
        self._pollers: list[tuple[str, Callable[[], None]]] = []
        self._batch: Any = None
        self._batch_step = 0
        self._finalized = False
        self._report: dict[str, Any] | None = None
        self._exceptions_seen: set[int] = set()
        self._optimizer_steps: dict[int, int] = {}
        self._stepping: tuple[int, int, Decision] | None = None  # (step, id(optimizer), decision) inside a step
        self._other_ranks_failures: list[Any] | None = None
        self._stepped = -1  # the last before_optimizer_step's step
        self.batches = 0
        """Training micro-batches seen: a run of none checked nothing, and its report must not call it clean."""
        self.finished = self.started = False
        if context.is_global_zero:
            for writer, log_dir in self.failures.call("TensorBoard layout", context.tensorboard_writers) or []:
                self.failures.call("TensorBoard layout", attach_to_writer, writer, self.session, log_dir)
        for monitor in monitors:
            self.add(monitor)

    def add(self, monitor: Monitor) -> None:
        """Bind ``monitor`` to this run and call it at the events it declares (areas in a fixed order)."""
        monitor.bind(self.session, self.context, self.numerics)
        monitor.share(self.ledger)
        self.monitors.append(monitor)
        self.monitors.sort(key=lambda m: AREA_ORDER.index(m.area))
        if not monitor.due_events <= monitor.events & GATED_EVENTS:
            raise TypeError(f"{type(monitor).__name__}.due_events must be among its events and "
                            f"{sorted(event.value for event in GATED_EVENTS)}")
        for event in Event:
            self._handlers[event] = [(f"{type(m).__name__}.{event.value}", getattr(m, event.value),
                                      m.schedule.frequency if event in m.due_events else 1, m)
                                     for m in self.monitors if event in m.events]
        self._pollers = [(f"{type(m).__name__}.poll", m.poll) for m in self.monitors if type(m).poll is not Monitor.poll]

    def monitor(self, area: Area) -> Monitor | None:
        return next((m for m in self.monitors if m.area is area), None)

    def _emit(self, event: Event, *args: Any) -> None:
        call = self.failures.call
        for name, handler, every, _ in self._handlers[event]:
            if every == 1 or args[0] % every == 0:  # a gated event's first argument is its step
                call(name, handler, *args)

    # --- events ---------------------------------------------------------------------------------
    @_own_time
    def start(self, step: int) -> None:
        """Training starts (or resumes after a checkpoint) at optimizer step ``step``."""
        self.failures.step = step
        self.started = True
        several = self.failures.call("listing the optimizers", lambda: len(self.context.optimizers()) > 1)
        self.ledger.record = self.ledger.record.moved(step=step, steps_done=step, several_optimizers=bool(several))
        self._emit(Event.START, step)

    @_own_time
    def epoch_start(self, step: int) -> None:
        self._emit(Event.EPOCH_START, step)

    @_own_time
    def batch_start(self, step: int, batch: Any, captured: Any = None) -> None:
        """A micro-batch of step ``step`` starts (``captured``: what a replay recomputes it from)."""
        self.failures.step = step
        self._stepping = None
        self._batch, self._batch_step = batch, step
        self.ledger.record = self.ledger.record.at_batch(step)
        call = self.failures.call
        for name, poll in self._pollers:
            call(name, poll)
        numerics = self.numerics
        if numerics.pending:
            call("reading back measurements", numerics.poll)
        oldest = numerics.oldest_pending_step
        call("logging debug scalars", self.session.metrics.flush_before, step if oldest is None else min(step, oldest))
        self._emit(Event.BATCH_START, step, batch, captured)
        self.ledger.phase = MemoryPhase.FORWARD

    @_own_time
    def before_backward(self, step: int, loss: Any) -> None:
        """A backward starts; after the step's :meth:`before_optimizer_step`, an L-BFGS trial point: not judged."""
        if self._stepping is not None and self._stepping[0] == step:
            return
        self._emit(Event.BEFORE_BACKWARD, step, loss)
        self.ledger.phase = MemoryPhase.BACKWARD

    @_own_time
    def before_optimizer_step(self, step: int, optimizer: Any) -> Decision:
        """Gradients are final: run the checks due (through :meth:`.Gate.optimizer_step`) and return what happens to
        this step (on SKIP and STOP the gradients are dropped here). With several optimizers the checks count
        ``optimizer``'s own steps. A closure evaluated again (L-BFGS) gets the first call's decision."""
        stepping = self._stepping
        if stepping is not None and stepping[:2] == (step, id(optimizer)):
            self.ledger.reevaluates = True
            if stepping[2] is not Decision.CONTINUE:
                drop_gradients(optimizer)
            return stepping[2]
        context = self.context
        own = self.failures.call("listing the optimizers", own_step, context, self.ledger, self._optimizer_steps,
                                 optimizer)
        if own is None and self.ledger.record.optimizer_step is not None:  # listing failed
            self.ledger.record = self.ledger.record.moved(optimizer_step=None)
        owner = optimizer if own is not None else None

        def numerics() -> StepNumerics:
            return self.numerics.get(step, context.named_parameters, self.gate.reducer(context.all_reduce()),
                                     context.grad_scale(), optimizer=owner, plain_sharded=context.grads_sharded)

        self._stepped = step
        due = [(name, handler, monitor) for name, handler, every, monitor in self._handlers[Event.BEFORE_OPTIMIZER_STEP]
               if step % every == 0]
        decision = Decision(self.gate.optimizer_step(step, due, self.numerics.scheduled_step(step), numerics,
                                                     optimizer))
        self.ledger.phase = MemoryPhase.OPTIMIZER
        self._stepping = (step, id(optimizer), decision)
        if decision is not Decision.CONTINUE:
            drop_gradients(optimizer)
        return decision

    @_own_time
    def after_optimizer_step(self, steps_done: int) -> None:
        """``steps_done`` optimizer steps have been taken (called after every micro-batch)."""
        self._stepping = None
        self.ledger.record = self.ledger.record.done(steps_done)
        self._emit(Event.AFTER_OPTIMIZER_STEP, steps_done)

    @_own_time
    def batch_end(self, batch: Any = None) -> None:
        """The micro-batch ends; the collectives the monitors plan for it are made whatever failed before them."""
        step = self._batch_step
        self.gate.open(step, self.gate.plan_batch_end(self.monitors, step, self._stepped == step))
        try:
            self._emit(Event.BATCH_END, step, batch if batch is not None else self._batch)
        finally:
            self.gate.close()
        self._batch = None
        self.batches += 1
        self.ledger.phase = None

    @_own_time
    def evaluation(self, step: int, started: bool, batch: Any = None) -> None:
        """Evaluation between training steps starts (a batch of it) or ends."""
        self._batch = batch if started else None
        self._emit(Event.EVALUATION, step, started)
        self.ledger.phase = MemoryPhase.VALIDATION if started else None

    @_own_time
    def exception(self, step: int, error: BaseException) -> None:
        """The loop raised ``error``; monitors leave their post-mortems (once per error)."""
        if id(error) in self._exceptions_seen:
            return
        self._exceptions_seen.add(id(error))
        self._emit(Event.EXCEPTION, step, error, self._batch)

    # --- the end --------------------------------------------------------------------------------
    @_own_time
    def logging_row(self, log: Callable[[dict[str, float]], None]) -> None:
        """The framework writes a logging row now (call on every rank): ``log`` gets, on rank zero, the scalars since
        the last row, pending ones read first (the framework syncs on its logging steps anyway)."""
        if not self.logs_on_rows:
            return
        call = self.failures.call
        if self.numerics.pending:
            call("reading back measurements", self.numerics.poll, True)
        for name, poll in self._pollers:
            call(name, poll)
        metrics = self.session.metrics
        if metrics.rows:
            call("logging debug scalars", log, metrics.take())

    def deliver_pending(self) -> None:
        """Read every pending measurement now (a sync on CUDA): before a checkpoint or the report."""
        self.failures.call("reading back measurements", self.numerics.poll, True)

    def finalize(self, step: int) -> None:
        """Last measurements: everything pending is evaluated and open episodes close at ``step``."""
        if self._finalized:
            return
        self._finalized = True
        self.deliver_pending()
        for monitor in self.monitors:
            self.failures.call(f"{type(monitor).__name__}.finalize", monitor.finalize, step)

    def _report_section(self, monitor: Monitor) -> dict[str, Any]:
        """``monitor``'s part of the report; if building it raises, a failed check and the area's findings only."""
        try:
            return monitor.report_section()
        except Exception as failure:  # one broken section must not lose the others
            self.failures.record(f"{type(monitor).__name__}.report_section", failure,
                                 "this area's statistics are not in the report (its findings are)")
            findings = self.failures.call(f"{type(monitor).__name__}.report_section", monitor.tally.state_dict)
            return {"findings": findings or {}, "error": f"{type(failure).__name__}: {failure}"}

    def _gather_failures(self) -> bool:
        """Gather every rank's failed checks for rank zero (a bounded wait); whether every rank took part."""
        try:
            self._other_ranks_failures = gather_failures(self.failures.summary(),
                                                         functools.partial(self.gate.gather, "failed checks"))
        except Exception as failure:
            self.failures.record("gathering every rank's failed checks", failure,
                                 "this report lists this rank's failed checks only")
            return False
        return True

    def failed_checks(self) -> dict[str, dict[str, Any]]:
        """The failed checks of this run, with those of every rank on rank zero once they are gathered."""
        own = self.failures.summary()
        if self._other_ranks_failures is None or not self.session.is_global_zero:
            return own
        return merge_failures(own, self._other_ranks_failures, self.context.rank)

    def abandon(self) -> bool:
        """End, writing nothing, a run whose fit ended before training started and without an error (Lightning's
        ``Tuner`` leaves from ``on_fit_start``: a report would say "0 steps" of a run that trained); else False."""
        if self.finished or self.started or self._finalized:
            return False
        self.finished = True
        self._release()
        return True

    def _release(self) -> None:
        """Put back what the monitors changed (hooks, anomaly mode, allocation history), unroute the console."""
        for monitor in self.monitors:
            self.failures.call(f"{type(monitor).__name__}.restore", monitor.restore)
            monitor.unbind()
        self.numerics.close()
        if self._unroute is not None:
            self._unroute()

    def finish(self, status: RunStatus | str, step: int, error: str | None = None,
               exit_code: int | None = None) -> dict[str, Any] | None:
        """Finalize (at ``step - 1``), write the last scalars and the report, conclude, restore; returns the report.
        ``step``: optimizer steps taken; ``exit_code``: what a ``SystemExit`` asked for. On several ranks a second
        bounded wait keeps every rank alive (``ddp_spawn`` kills the others) while rank zero writes."""
        if self.finished:
            return self._report
        status = RunStatus.parse(status)
        self.finished = True
        self.finalize(max(step - 1, 0))
        self.failures.call("logging debug scalars", self.session.metrics.flush_before, None)
        together = status is RunStatus.FINISHED and self.context.world_size > 1 and self._gather_failures()
        sections = {monitor.area.value: self._report_section(monitor) for monitor in self.monitors}

        def render_failed(area: str, failure: Exception) -> None:
            self.failures.record(f"rendering the {area} section", failure,
                                 f"report.md has no {area} section; the area's findings are still in the report")

        report = self.failures.call("building the report", build_report, status=status, step=step, sections=sections,
                                    config=self.config.to_dict(), error=error, failures=self.failed_checks(),
                                    run_id=self.context.run_id, on_render_failure=render_failed)
        if report is not None:
            report["failed_checks"] = self.failed_checks()
            report["training_batches"] = self.batches
            report.update(coverage({monitor.area for monitor in self.monitors}))
            if exit_code is not None:
                report["exit_code"] = exit_code
            report["started"], report["ended"] = moment(self.began), moment(time.time())
        self._report = report
        written = False
        if report is not None and self.session.output_dir is not None:
            try:
                write_report(self.session.output_dir, report)
                written = True
            except Exception as failure:
                self.failures.record("writing the report", failure,
                                     "report.json and report.md of this run are not written (a previous complete "
                                     "version, if any, is left as it was)")
                report["failed_checks"] = self.failed_checks()  # what the summary and the caller see
        if report is not None and self.session.is_global_zero:
            def attach(files: list) -> list[str]:
                return attach_files(self.context.artifact_stores(), files)
            self.failures.call("concluding the run", conclude_run, self.session, report, self.config, attach, written)
        if together:
            self.failures.call("waiting for every rank at the end of the run", bounded_wait)
        self._release()
        return report
