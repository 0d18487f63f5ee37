"""One run's shared state: the events file, the logger writes, the report, the step measurements.

Every callback of a run (and the Accelerate debugger) holds the same :class:`DebugSession`, so
there is one events.jsonl, one report and one gradient pass per step however many are enabled.
Only the global-zero process writes; the other ranks measure and take part in collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_debug.core.events import EventLog
from lightning_debug.core.findings import Finding
from lightning_debug.core.metrics import MetricsSink, MetricsWriter
from lightning_debug.core.report import build_report, write_report
from lightning_debug.core.step_numerics import AllGather, StepNumerics
from lightning_debug.core.timeline import Timeline

MAX_PENDING_READBACKS = 4


class ReportContributor(Protocol):
    report_name: str

    def report_section(self) -> dict[str, Any]: ...


class DebugSession:
    """Shared writer and measurement cache of one run.

    Args:
        output_dir: Directory for events.jsonl and the reports, or None to write no files.
        is_global_zero: Only this process writes files and logger scalars.
        sink: Where a step's scalars go (``trainer.logger.log_metrics``, ``accelerator.log``).
        config: The run's configuration as plain values, copied into report.json.
    """

    def __init__(self, output_dir: Path | None, is_global_zero: bool, sink: MetricsSink | None,
                 config: dict[str, Any]) -> None:
        self.is_global_zero = is_global_zero
        self.output_dir = output_dir if is_global_zero else None
        self.events = EventLog(self.output_dir)
        self.timeline = Timeline()
        self.event_listeners: list[Callable[[dict[str, Any]], None]] = [self.timeline.observe_event]
        self.links: dict[str, str] = {}
        self._concluded = False
        self.metrics = MetricsWriter(self._with_timeline(sink) if is_global_zero else None)
        self.config = config
        self.contributors: list[ReportContributor] = []
        self._loss_finite: dict[int, torch.Tensor] = {}
        self._numerics: StepNumerics | None = None
        self.want_param_norms = False  # set by checks that need every weight's norm (weight logging)
        self._pending: list[StepNumerics] = []
        self._report_failed = False

    def _with_timeline(self, sink: MetricsSink | None) -> MetricsSink:
        """Scalars feed the timeline (the end-of-fit plots) and then the user's sink, if any."""

        def write(metrics: dict[str, float], step: int) -> None:
            self.timeline.observe_metrics(metrics, step)
            if sink is not None:
                sink(metrics, step)

        return write

    def join(self, contributor: ReportContributor) -> None:
        if contributor not in self.contributors:
            self.contributors.append(contributor)

    # --- findings -------------------------------------------------------------------------------
    def emit(self, finding: Finding, *, step: int, epoch: int, batch: int, callback: str,
             episode: str | None = None) -> None:
        record: dict[str, Any] = {
            "step": step, "epoch": epoch, "batch": batch, "kind": finding.kind, "severity": finding.severity,
            "callback": callback, "message": finding.message, "details": finding.details,
        }
        if episode is not None:
            record["episode"] = episode
        self.events.write(record)
        if self.is_global_zero:
            for listener in list(self.event_listeners):
                try:
                    listener(record)
                except Exception as failure:  # a broken listener (a closed logger) must not stop training
                    self.event_listeners.remove(listener)
                    warnings.warn(f"lightning-debug: an event listener failed ({type(failure).__name__}: {failure}) "
                                  "and was removed; events.jsonl still has every event.", RuntimeWarning)

    # --- shared per-step measurement --------------------------------------------------------------
    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """AND the finiteness of a micro-batch loss into this optimizer step's flag (no sync)."""
        finite = torch.isfinite(loss.detach()).all()
        previous = self._loss_finite.get(step)
        self._loss_finite = {step: finite if previous is None else previous & finite}

    def step_numerics(self, step: int, named_parameters: Callable[[], Any], all_gather: AllGather | None,
                      grads_sharded: bool = False, grad_scale: torch.Tensor | None = None) -> StepNumerics:
        """This step's :class:`StepNumerics`, computed by the first caller, shared with the rest."""
        if self._numerics is None or self._numerics.step != step:
            self._numerics = StepNumerics(step, list(named_parameters()), self._loss_finite.pop(step, None),
                                          all_gather, grads_sharded, grad_scale, self.want_param_norms)
            self._pending.append(self._numerics)
        return self._numerics

    def poll(self, final: bool = False) -> None:
        """Stage pending measurements for read-back and deliver those whose copy has completed.

        Deferred reads are bounded: past a few pending steps the oldest is read with a sync.
        """
        for numerics in self._pending:
            numerics.stage(blocking=False)
        while self._pending and (final or self._pending[0].ready() or len(self._pending) > MAX_PENDING_READBACKS):
            self._pending.pop(0).deliver()

    def end_step(self, step: int) -> None:
        """Deliver ready measurements and write every step's scalars that can no longer change."""
        self.poll()
        oldest_undelivered = min((n.step for n in self._pending), default=step + 1)
        self.metrics.flush_before(min(step + 1, oldest_undelivered))

    # --- the end --------------------------------------------------------------------------------
    def finish(self, status: str, step: int, error: str | None = None, final: bool = True) -> dict[str, Any]:
        """Deliver everything, write all scalars and (re)write report.json / report.md.

        ``final`` marks the last call of the run (the last callback to finish): then, once per run
        on the global-zero process, the plots are drawn and the console summary is printed.
        """
        self.poll(final=True)
        self.metrics.flush_before(None)
        sections = {}
        for contributor in self.contributors:
            try:
                sections[contributor.report_name] = contributor.report_section()
            except Exception as failure:  # one broken section must not lose the others
                sections[contributor.report_name] = {"error": f"{type(failure).__name__}: {failure}"}
        report = build_report(status=status, step=step, sections=sections, config=self.config, error=error)
        if self.output_dir is not None and not self._report_failed:
            try:
                write_report(self.output_dir, report)
            except OSError as failure:
                self._report_failed = True
                warnings.warn(f"lightning-debug could not write the report to {self.output_dir} ({failure}); "
                              "training continues.", RuntimeWarning)
        if final:
            self.conclude(report)
        return report

    def conclude(self, report: dict[str, Any]) -> None:
        """Once per run, on the global-zero process: debug_analysis.png and the console summary."""
        if self._concluded or not self.is_global_zero:
            return
        self._concluded = True
        from lightning_debug.summary import conclude_run

        conclude_run(self, report)
