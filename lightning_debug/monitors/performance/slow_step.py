"""The slow-step rule: a timed step that is a robust outlier of this run's recent steps, and the phase to blame."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.robust import robust_sigma
from lightning_debug.checks.timing import PHASES, Phase, StepTimes
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.stats import Window
from lightning_debug.monitors.performance.settings import PerformanceSettings

RECENT_STEPS = 50
MIN_HISTORY = 5
# A slow step is a robust outlier: above the median by (slow_step_factor - 1) medians, by SLOW_MAD_Z
# robust standard deviations and by MIN_SLOW_EXCESS_MS. It is a warning when it recurs
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

PHASE_HINTS = {
    Phase.DATA: "the data wait grew: a slow sample or shard, data-loader workers restarting at an epoch boundary, "
                "disk or network I/O, or work between steps (checkpointing, logging, a callback)",
    Phase.FORWARD: "the training_step itself was slow: a new input shape (recompilation, cuDNN autotuning), a host "
                   "sync such as .item() or printing a tensor, or I/O inside the step",
    Phase.BACKWARD: "the backward pass was slow: a new graph shape, or waiting for another rank in the gradient "
                    "all-reduce",
    Phase.OPTIMIZER: "the optimizer step was slow: optimizer state allocated lazily on the first step, a hook or "
                     "an LR scheduler doing extra work",
}


@dataclass(frozen=True)
class SlowStep:
    """A slow step found: its times, the run's recent medians, and the phase that grew the most."""

    step: int
    phase: Phase
    step_ms: float
    median_step_ms: float
    phase_ms: float
    median_phase_ms: float
    threshold_ms: float
    slow_steps: int
    window_steps: int
    recurring: bool
    phases_ms: dict[Phase, float]
    plugin_ms: float
    cpu_wait_ms: float
    threshold_factor: float

    @property
    def key(self) -> str:
        """Episodes by phase; a lone outlier is an episode of its own."""
        return self.phase.value if self.recurring else f"{self.phase.value} (once)"

    def finding(self) -> Finding:
        how_often = (f"{self.slow_steps} of the last {self.window_steps} timed steps were this slow" if self.recurring
                     else "a single step so far (it becomes a warning if it recurs)")
        factor = self.step_ms / self.median_step_ms
        details: dict[str, Any] = {
            "phase": self.phase.value, "step_ms": self.step_ms, "median_step_ms": self.median_step_ms,
            "factor": factor, "phase_ms": self.phase_ms, "median_phase_ms": self.median_phase_ms,
            "threshold_ms": self.threshold_ms, "slow_steps": self.slow_steps, "window_steps": self.window_steps,
            "recurring": self.recurring, "phases_ms": {phase.value: ms for phase, ms in self.phases_ms.items()},
            "plugin_ms": self.plugin_ms, "cpu_wait_ms": self.cpu_wait_ms, "threshold_factor": self.threshold_factor}
        return Finding(
            Kind.SLOW_STEP, Severity.WARNING if self.recurring else Severity.INFO,
            f"Step {self.step} took {self.step_ms:.1f} ms, {factor:.1f}x the recent median of "
            f"{self.median_step_ms:.1f} ms ({how_often}); the {self.phase.value} phase took {self.phase_ms:.1f} ms "
            f"(median {self.median_phase_ms:.1f} ms), so {PHASE_HINTS[self.phase]}.", details)


class SlowStepRule:
    """Whether a timed step is slow for this run, judged against the last ``RECENT_STEPS`` timed steps.

    What could make it fire on a healthy model: ordinary jitter (a garbage collection, a busy
    machine, a logging step), which a plain factor over the median flags on a fast model. A step
    counts as an outlier only above the median by ``slow_step_factor - 1`` medians, by
    ``SLOW_MAD_Z`` robust standard deviations of the run's own spread and by ``MIN_SLOW_EXCESS_MS``;
    times are judged without the plugin's own time and the measured wait for a CPU. It warns only
    when outliers recur; a lone outlier is an info, and only when it is far out. The history is
    bounded (``RECENT_STEPS`` times per phase, ``SLOW_WINDOW`` flags).

    Example::

        >>> def times(step, forward):
        ...     return StepTimes(step, {Phase.DATA: 1.0, Phase.FORWARD: forward, Phase.BACKWARD: 20.0,
        ...                             Phase.OPTIMIZER: 5.0})
        >>> rule, settings = SlowStepRule(), PerformanceSettings()
        >>> for step in range(6):
        ...     assert rule.judge(times(step, 10.0), settings) is None
        ...     rule.remember(times(step, 10.0))
        >>> verdict = rule.judge(times(6, 5000.0), settings)
        >>> verdict.phase.value, verdict.recurring, verdict.key, verdict.finding().severity.value
        ('forward', False, 'forward (once)', 'info')
    """

    def __init__(self) -> None:
        self.steps = Window(RECENT_STEPS)
        self.phases = {phase: Window(RECENT_STEPS) for phase in PHASES}
        self.flags: deque[bool] = deque(maxlen=SLOW_WINDOW)

    def threshold_ms(self, settings: PerformanceSettings) -> float | None:
        """The step time above which a step is an outlier of this run (None until enough history)."""
        if len(self.steps) < MIN_HISTORY:
            return None
        median = self.steps.median()
        sigma = robust_sigma(list(self.steps.values), median)
        return median + max((settings.slow_step_factor - 1) * median, SLOW_MAD_Z * sigma, MIN_SLOW_EXCESS_MS)

    def judge(self, times: StepTimes, settings: PerformanceSettings) -> SlowStep | None:
        """Judge one timed step against the history before it (flags it as an outlier or not)."""
        threshold = self.threshold_ms(settings)
        if threshold is None:
            return None
        median = self.steps.median()
        judged = times.judged_step_ms
        outlier = judged > threshold
        self.flags.append(outlier)
        if not outlier:
            return None
        flagged = sum(self.flags)
        recurring = flagged >= SLOW_MIN_FLAGGED
        if not recurring and not (judged >= SLOW_LONE_FACTOR * median and judged - median >= SLOW_LONE_MS):
            return None
        excess = {phase: times.judged(phase) - self.phases[phase].median() for phase in PHASES}
        phase = max(excess, key=lambda name: excess[name])
        return SlowStep(times.step, phase, times.step_ms, median, times.phases[phase], self.phases[phase].median(),
                        threshold, flagged, len(self.flags), recurring, dict(times.phases), times.own_ms,
                        sum(times.cpu_waits.values()), settings.slow_step_factor)

    def remember(self, times: StepTimes) -> None:
        """Add a timed step to the history (after it was judged)."""
        self.steps.add(times.judged_step_ms)
        for phase in PHASES:
            self.phases[phase].add(times.judged(phase))
