"""Slow steps that do not end: the step time moved to a new level (a schedule that grows the input, a backbone
unfrozen, a slower machine), told apart from a burst of stalls by what the steps after them do.

A run of slow steps in a row is held by the verdict engine under the ``slow_step`` policy
(``Confirm(until=Until.BACK_UNDER)``); :class:`SlowRun` is what the rule measured over it, kept in the held
suspicion (and so in the checkpoint) as plain values.

Example::

    >>> shift = Shift(start=200, steps=12, before_ms=16.0, after_ms=96.0, phase_before_ms=9.0, phase_after_ms=61.0,
    ...               elements_ratio=4.0)
    >>> finding = shift.finding(Phase.FORWARD)
    >>> finding.severity.value, finding.details["factor"], "4.0x the elements" in finding.message
    ('info', 6.0, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_debug.checks.timing import PHASES, Phase, StepTimes
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity

SHIFT_ELEMENTS_RATIO = 1.5
"""Input elements per step grown by this factor explain a shift: a sequence-length or batch-size schedule."""


@dataclass(frozen=True)
class Shift:
    """Slow steps in a row that did not end: the run's step time moved to a new level at ``start`` (and the
    judged step stopped being an outlier because the recent median followed it, not because it got faster)."""

    start: int
    steps: int
    before_ms: float
    after_ms: float
    phase_before_ms: float
    phase_after_ms: float
    elements_ratio: float | None
    ended_run: bool = False
    """The shift lasted to the end of the run, too few steps to tell it from a stall at the end."""

    def finding(self, phase: Phase) -> Finding:
        factor = self.after_ms / self.before_ms if self.before_ms > 0 else math.inf
        if self.elements_ratio is not None and self.elements_ratio >= SHIFT_ELEMENTS_RATIO:
            why = (f"each step's input has {self.elements_ratio:.1f}x the elements it had: a longer sequence, a larger "
                   "image or a larger batch (a schedule that grows them) costs this by design")
        else:
            why = ("the input per step did not grow: more trainable parameters (a backbone unfrozen), another code "
                   "path in training_step, or a slower machine (another process, throttling) would do this")
        lasted = ("until the end of the run, too few steps to tell a new level from a stall" if self.ended_run
                  else "and stayed there: a new level, not a stall")
        return Finding(
            Kind.SLOW_STEP, Severity.INFO,
            f"From step {self.start} on, steps take {self.after_ms:.1f} ms instead of {self.before_ms:.1f} ms "
            f"({factor:.1f}x), {self.steps} timed step(s) in a row, {lasted}; the {phase.value} phase grew the "
            f"most ({self.phase_before_ms:.1f} -> {self.phase_after_ms:.1f} ms). {why[0].upper()}{why[1:]}.",
            {"phase": phase.value, "shift_step": self.start, "before_ms": self.before_ms,
             "after_ms": self.after_ms, "factor": factor, "timed_steps": self.steps,
             "elements_ratio": self.elements_ratio, "ended_run": self.ended_run, "recurring": False})


@dataclass
class SlowRun:
    """Outliers on consecutive timed steps, from ``start``: what the run looked like before, and their sums.

    Example::

        >>> run = SlowRun(10, 16.0, 66.0, {phase: 4.0 for phase in PHASES}, None)
        >>> run.add(StepTimes(10, {phase: 40.0 for phase in PHASES}))
        >>> SlowRun.from_state(run.state_dict()) == run, run.shift(Phase.DATA).after_ms
        (True, 160.0)
    """

    start: int
    base_median: float
    base_threshold: float
    base_phases: dict[Phase, float]
    base_elements: float | None
    length: int = 0
    total_ms: float = 0.0
    phase_ms: dict[Phase, float] = field(default_factory=dict)
    elements: int = 0
    held: dict[str, Any] | None = None
    """The verdict held back while the run lasts, as its state (see :class:`~.slow_step.SlowStepRule`)."""
    explained: bool = True
    """Whether every step of the run had a larger input than usual and an ordinary time for it: if it ends, no burst."""

    def add(self, times: StepTimes) -> None:
        self.length += 1
        self.total_ms += times.judged_step_ms
        for phase in PHASES:
            self.phase_ms[phase] = self.phase_ms.get(phase, 0.0) + times.judged(phase)
        self.elements += times.elements or 0

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "base_median": self.base_median, "base_threshold": self.base_threshold,
                "base_phases": {phase.value: ms for phase, ms in self.base_phases.items()},
                "base_elements": self.base_elements, "length": self.length, "total_ms": self.total_ms,
                "phase_ms": {phase.value: ms for phase, ms in self.phase_ms.items()}, "elements": self.elements,
                "held": self.held, "explained": self.explained}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SlowRun:
        return cls(int(state["start"]), float(state["base_median"]), float(state["base_threshold"]),
                   {Phase(name): float(ms) for name, ms in state["base_phases"].items()}, state["base_elements"],
                   int(state["length"]), float(state["total_ms"]),
                   {Phase(name): float(ms) for name, ms in state["phase_ms"].items()}, int(state["elements"]),
                   state["held"], bool(state["explained"]))

    def shift(self, phase: Phase, ended_run: bool = False) -> Shift:
        ratio = (self.elements / self.length / self.base_elements
                 if self.elements and self.base_elements else None)
        return Shift(self.start, self.length, self.base_median, self.total_ms / self.length,
                     self.base_phases[phase], self.phase_ms[phase] / self.length, ratio, ended_run)
