"""The slow-step rule: a timed step that is a robust outlier of this run's recent steps, and the phase to blame."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_debug.checks.robust import median as robust_median, robust_sigma
from lightning_debug.checks.timing import PHASES, Phase, StepTimes
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.stats import Window
from lightning_debug.core.verdicts import Confirmed, ConfirmedBy, Suspicion, VerdictEngine
from lightning_debug.monitors.performance.settings import PerformanceSettings

RECENT_STEPS = 50
MIN_HISTORY = 5
# The rule's bounds (see SlowStepRule). A busy machine delays bursts of steps by tens of milliseconds beyond the
# measured wait for a CPU (a busy hyperthread sibling, a hypervisor's steal time), hence MIN_SLOW_EXCESS_MS.
SLOW_MAD_Z = 6.0
MIN_SLOW_EXCESS_MS = 50.0
SLOW_WINDOW = 10
SLOW_MIN_FLAGGED = 3
SLOW_LONE_FACTOR = 20.0
SLOW_LONE_MS = 250.0
# A stall recurs with a period (the last PERIOD_MIN_OUTLIERS outliers every k-th step, k >= 2) or often
# (FAR_MIN_OUTLIERS far outliers, FAR_MS over the median, at least FAR_MIN_FRACTION of the recent timed steps).
PERIOD_MIN_OUTLIERS = 4
# Only a periodic stall costing this share of the time is a warning: a checkpoint every thousand steps is a rhythm.
MIN_PERIODIC_SHARE = 0.05
PERIOD_NAMED_OUTLIERS = 3  # a recurrence found otherwise names its period from three equidistant outliers
FAR_MS = 100.0
# A stall too small for the threshold, or on so many timed steps that the median is its own, is still a rhythm when
# RHYTHM_RECURRENCES of them in a row come at one period and one cost (the largest excess at most RHYTHM_SPREAD times
# the smallest, each at least RHYTHM_MIN_EXCESS_MS and slow_step_factor over the steps between them, which stay
# under half of it): one call recurring, where a busy machine's bursts come at random times and sizes.
RHYTHM_RECURRENCES = 6
RHYTHM_MIN_EXCESS_MS = 10.0
RHYTHM_SPREAD = 1.5
FAR_MIN_OUTLIERS = 5
FAR_MIN_FRACTION = 0.1
# A step whose input has more than SIZE_BAND times the recent median's elements (a long bucket of a length-bucketed
# or dynamically padded loader) is judged against the recent steps whose inputs are within SIZE_BAND of its own.
SIZE_BAND = 1.25
RUN = "run"  # the key of the run of slow steps in a row the verdict engine holds (one at a time)
# Input elements per step grown by this factor explain a shift: a sequence-length or batch-size schedule.
SHIFT_ELEMENTS_RATIO = 1.5


@dataclass
class SlowRun:
    """Outliers on consecutive timed steps, from ``start``: what the run looked like before, and their sums. One that
    did not end is a shift: the step time moved to a new level (a growing input, a backbone unfrozen, a slower
    machine).

    Example::

        >>> run = SlowRun(200, 16.0, 66.0, {phase: 9.0 for phase in PHASES}, 100.0)
        >>> run.add(StepTimes(200, {phase: 24.0 for phase in PHASES}, elements=400))
        >>> finding = run.finding(Phase.FORWARD)
        >>> SlowRun.from_state(run.state_dict()) == run, finding.details["after_ms"], finding.details["factor"]
        (True, 96.0, 6.0)
        >>> finding.severity.value, "4.0x the elements" in finding.message
        ('info', True)
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
    held: dict[str, Any] | None = None  # the verdict held back while the run lasts, as its state
    explained: bool = True  # every step had a larger input than usual and an ordinary time for it: no burst
    ended_run: bool = False  # a shift that lasted to the end of the run: too few steps to tell it from a stall

    def add(self, times: StepTimes) -> None:
        self.length += 1
        self.total_ms += times.judged_step_ms
        for phase in PHASES:
            self.phase_ms[phase] = self.phase_ms.get(phase, 0.0) + times.judged(phase)
        self.elements += times.elements or 0

    def state_dict(self) -> dict[str, Any]:
        return dict(asdict(self), base_phases=by_name(self.base_phases), phase_ms=by_name(self.phase_ms))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SlowRun:
        return cls(**dict(state, base_phases=by_phase(state["base_phases"]), phase_ms=by_phase(state["phase_ms"])))

    def finding(self, phase: Phase) -> Finding:
        """The shift's finding, ``phase`` the one that grew the most."""
        before, after = self.base_median, self.total_ms / self.length
        ratio = self.elements / self.length / self.base_elements if self.elements and self.base_elements else None
        factor = after / before if before > 0 else math.inf
        if ratio is not None and ratio >= SHIFT_ELEMENTS_RATIO:
            why = (f"each step's input has {ratio:.1f}x the elements it had: a longer sequence, a larger "
                   "image or a larger batch (a schedule that grows them) costs this by design")
        else:
            why = ("the input per step did not grow: more trainable parameters (a backbone unfrozen), another code "
                   "path in training_step, or a slower machine (another process, throttling) would do this")
        lasted = ("until the end of the run, too few steps to tell a new level from a stall" if self.ended_run
                  else "and stayed there: a new level, not a stall")
        return Finding(
            Kind.SLOW_STEP, Severity.INFO,
            f"From step {self.start} on, steps take {after:.1f} ms instead of {before:.1f} ms "
            f"({factor:.1f}x), {self.length} timed step(s) in a row, {lasted}; the {phase.value} phase grew the "
            f"most ({self.base_phases[phase]:.1f} -> {self.phase_ms[phase] / self.length:.1f} ms). "
            f"{why[0].upper()}{why[1:]}.",
            {"phase": phase.value, "shift_step": self.start, "before_ms": before, "after_ms": after,
             "factor": factor, "timed_steps": self.length, "elements_ratio": ratio, "ended_run": self.ended_run,
             "recurring": False})


def by_name(times: dict[Phase, float]) -> dict[str, float]:
    """Times by phase name, for a checkpoint or an event."""
    return {phase.value: ms for phase, ms in times.items()}


def by_phase(times: dict[str, float]) -> dict[Phase, float]:
    return {Phase(name): float(ms) for name, ms in times.items()}


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


def smallest_period(period: int, timing_frequency: int) -> int:
    """The shortest true period of a stall seen every ``period`` timed steps when only every ``timing_frequency``-th
    step is timed (the smallest ``k >= 2`` with ``lcm(k, timing_frequency) == period``): what it may cost.

    Example::

        >>> smallest_period(30, 10), smallest_period(1000, 10), smallest_period(16, 1)
        (3, 1000, 16)
    """
    if timing_frequency <= 1:
        return period
    return next((k for k in range(2, period + 1) if period % k == 0 and math.lcm(k, timing_frequency) == period),
                period)


def time_share(excess_ms: float, period: int, median_ms: float) -> float:
    """The share of the time a stall of ``excess_ms`` every ``period`` steps of ``median_ms`` costs.

    Example::

        >>> round(time_share(50.0, 16, 2.5), 2), round(time_share(400.0, 1000, 100.0), 4)
        (0.56, 0.004)
    """
    total = period * median_ms + excess_ms
    return excess_ms / total if total > 0 else 1.0


def ordinal(number: int) -> str:
    """Every k-th step, in words.

    Example::

        >>> [ordinal(k) for k in (2, 3, 5, 11, 12, 21, 30)]
        ['2nd', '3rd', '5th', '11th', '12th', '21st', '30th']
    """
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


@dataclass(frozen=True)
class SlowStep:
    """A slow step found: its times, the recent medians, and the phase that grew the most."""

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
    period: int | None = None
    outliers: int = 0
    timed_steps: int = 0
    outlier_steps: tuple[int, ...] = ()
    timing_frequency: int = 1
    hooks: dict[str, list[int]] | None = None
    share: float | None = None  # a stall that recurs only with a period: the share of the time it costs (at most)
    epoch_start: bool = False  # the first step of an epoch, its data phase grew: the loader's iterator starting
    loader: dict[str, Any] | None = None
    shift: SlowRun | None = None  # set when the slow steps did not end but became the run's level

    def state_dict(self) -> dict[str, Any]:
        """For the verdict engine's checkpoint (a verdict is held before any shift is known)."""
        state = asdict(self)
        return dict(state, phase=self.phase.value, phases_ms=by_name(self.phases_ms),
                    outlier_steps=list(self.outlier_steps), shift=None)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SlowStep:
        return cls(**dict(state, phase=Phase(state["phase"]), outlier_steps=tuple(state["outlier_steps"]),
                          phases_ms=by_phase(state["phases_ms"])))

    @property
    def minor(self) -> bool:
        """A stall that recurs only with its period and costs less than ``MIN_PERIODIC_SHARE`` of the time."""
        return self.share is not None and self.share < MIN_PERIODIC_SHARE

    @property
    def key(self) -> str:
        """Episodes by phase; the infos (a lone outlier, a cheap periodic stall, a shift) have their own, so that an
        open one never hides a warning of the same phase."""
        if self.shift is not None:
            return f"{self.phase.value} (shift)"
        if not self.recurring:
            return f"{self.phase.value} (once)"
        return f"{self.phase.value} (rhythm)" if self.minor else self.phase.value

    @property
    def fraction(self) -> float:
        """The share of steps the stall hits: one in ``period``, else the outliers' share of the recent timed steps."""
        if self.period:
            return 1.0 / self.period
        return self.outliers / self.timed_steps if self.timed_steps else 0.0

    def _how_often(self) -> str:
        share = f"{self.outliers} of the last {self.timed_steps} timed steps"
        if self.period is not None:
            text = (f"it recurs every {ordinal(self.period)} step, {self.fraction:.0%} of steps ({share}; steps "
                    f"{', '.join(map(str, self.outlier_steps))})")
            if self.timing_frequency > 1:
                text += (f"; only every {ordinal(self.timing_frequency)} step is timed, so it may recur more often: "
                         "performance_profiling_frequency=1 times every step")
            if self.share is not None:
                text += (f"; it costs {'up to ' if self.timing_frequency > 1 else ''}{self.share:.1%} of the time"
                         + (f", under {MIN_PERIODIC_SHARE:.0%}: an info" if self.minor else ""))
            return text
        if self.recurring and self.slow_steps < SLOW_MIN_FLAGGED:
            return f"steps far above the median recur, {self.fraction:.0%} of steps ({share})"
        if self.recurring:
            return f"{self.slow_steps} of the last {self.window_steps} timed steps were this slow"
        return "a single step so far (it becomes a warning if it recurs)"

    def _cause(self) -> str:
        if not self.epoch_start:
            return PHASE_HINTS[self.phase]
        loader = self.loader or {}
        workers = loader.get("num_workers") or 0
        if workers and not loader.get("persistent_workers"):
            return (f"the first batch of an epoch waits while the DataLoader starts its {workers} worker process(es) "
                    "again, as it does every epoch with persistent_workers=False (and each re-runs the dataset's "
                    "setup): persistent_workers=True keeps them")
        return ("the first batch of an epoch waits while the loader's iterator starts (the sampler, the dataset's "
                "__iter__, worker setup)")

    def _hooks(self) -> str:
        if self.hooks is None or self.epoch_start:
            return ""
        if not self.hooks:
            return (" No validation or checkpoint saving ran in those steps: the time is the loop's own or the "
                    "step's (a logging flush, a garbage collection, I/O or a sleep in training_step).")
        ran = "; ".join(f"{name} (steps {', '.join(map(str, steps))})" for name, steps in self.hooks.items())
        return f" In those steps Lightning also ran: {ran}: a likely cause."

    def finding(self) -> Finding:
        if self.shift is not None:
            return self.shift.finding(self.phase)
        how_often = self._how_often()
        factor = self.step_ms / self.median_step_ms
        details: dict[str, Any] = {
            "phase": self.phase.value, "step_ms": self.step_ms, "median_step_ms": self.median_step_ms,
            "factor": factor, "phase_ms": self.phase_ms, "median_phase_ms": self.median_phase_ms,
            "threshold_ms": self.threshold_ms, "slow_steps": self.slow_steps, "window_steps": self.window_steps,
            "recurring": self.recurring, "phases_ms": by_name(self.phases_ms),
            "plugin_ms": self.plugin_ms, "cpu_wait_ms": self.cpu_wait_ms, "threshold_factor": self.threshold_factor,
            "period": self.period, "outliers": self.outliers, "timed_steps": self.timed_steps,
            "fraction": self.fraction, "outlier_steps": list(self.outlier_steps), "hooks": self.hooks,
            "time_share": self.share, "epoch_start": self.epoch_start}
        return Finding(
            Kind.SLOW_STEP, Severity.WARNING if self.recurring and not self.minor else Severity.INFO,
            f"Step {self.step} took {self.step_ms:.1f} ms, {factor:.1f}x the recent median of "
            f"{self.median_step_ms:.1f} ms; {how_often}; the {self.phase.value} phase took {self.phase_ms:.1f} ms "
            f"(median {self.median_phase_ms:.1f} ms), so {self._cause()}.{self._hooks()}", details)


class SlowStepRule:
    """Whether a timed step is slow for this run, judged against the last ``RECENT_STEPS`` timed steps.

    Jitter (a collection, a busy machine) is ruled out by needing the factor, ``SLOW_MAD_Z`` robust sigmas and
    ``MIN_SLOW_EXCESS_MS`` at once, without the plugin's own time and the CPU wait; it warns only when outliers
    recur (one alone is an info when far out), a periodic stall only when it costs ``MIN_PERIODIC_SHARE`` of the
    time. The engine holds a run of consecutive outliers (``Confirm(until=BACK_UNDER)``): back under the
    threshold of before it was a burst, else the level moved (an info). See docs/performance.md.

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

    def __init__(self, verdicts: VerdictEngine | None = None) -> None:
        self.verdicts = verdicts if verdicts is not None else VerdictEngine()
        self.steps = Window(RECENT_STEPS)
        self.phases = {phase: Window(RECENT_STEPS) for phase in PHASES}
        self.flags: deque[bool] = deque(maxlen=SLOW_WINDOW)
        self.timed: deque[int] = deque(maxlen=RECENT_STEPS)
        self.outlier_steps: deque[int] = deque(maxlen=RECENT_STEPS)
        self.far_steps: deque[int] = deque(maxlen=RECENT_STEPS)
        self.elements = Window(RECENT_STEPS)
        self.sized: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)  # (input elements, judged ms)
        self.history: deque[StepTimes] = deque(maxlen=RECENT_STEPS)

    def period(self, minimum: int = PERIOD_MIN_OUTLIERS) -> int | None:
        """The distance k >= 2 between each of the last ``minimum`` outliers, when it is one. A gap of a multiple
        of k counts when no step where the stall was due in between was timed (a profiler window, sparse timing)."""
        last = list(self.outlier_steps)[-minimum:]
        if len(last) < minimum:
            return None
        gaps = [later - earlier for earlier, later in zip(last, last[1:])]
        period = min(gaps)
        if period < 2 or any(gap % period for gap in gaps):
            return None
        if sum(1 for step in self.timed if last[0] <= step <= last[-1]) == len(last):
            return None  # every timed step between them was slow: a run of slow steps, not a rhythm
        timed = set(self.timed)
        due = (earlier + period * j for earlier, gap in zip(last, gaps) for j in range(1, gap // period))
        return None if any(step in timed for step in due) else period

    def recent_outliers(self) -> list[int]:
        return self._recent(self.outlier_steps)

    def ongoing(self, step: int) -> bool:
        """Whether ``step`` lies between two recurrences of a periodic stall (its episode stays open)."""
        period = self.period()
        return period is not None and bool(self.outlier_steps) and step - self.outlier_steps[-1] < 2 * period

    def _recent(self, steps: deque[int]) -> list[int]:
        oldest = self.timed[0] if self.timed else 0
        return [step for step in steps if step >= oldest]

    def _threshold(self, settings: PerformanceSettings, median: float, values: list[float] | None = None) -> float:
        sigma = robust_sigma(list(self.steps.values) if values is None else values, median)
        return median + max((settings.slow_step_factor - 1) * median, SLOW_MAD_Z * sigma, MIN_SLOW_EXCESS_MS)

    def _size_threshold(self, settings: PerformanceSettings, elements: int) -> float | None:
        """The threshold among the recent steps whose input is within ``SIZE_BAND`` of ``elements`` (or None)."""
        peers = [ms for size, ms in self.sized if elements / SIZE_BAND <= size <= elements * SIZE_BAND]
        return self._threshold(settings, robust_median(peers), peers) if len(peers) >= MIN_HISTORY else None

    def _explained_by_size(self, times: StepTimes, settings: PerformanceSettings) -> bool:
        """Whether an outlier's input is larger than usual and its time ordinary for that size (or unknown)."""
        if not (times.elements and len(self.elements) and times.elements > SIZE_BAND * self.elements.median()):
            return False
        own_size = self._size_threshold(settings, times.elements)
        return own_size is None or times.judged_step_ms <= own_size

    def _verdict(self, times: StepTimes, settings: PerformanceSettings, median: float, threshold: float,
                 recurring: bool, period: int | None, outliers: list[int], share: float | None) -> SlowStep:
        excess = {phase: times.judged(phase) - self.phases[phase].median() for phase in PHASES}
        phase = max(excess, key=lambda name: excess[name])
        return SlowStep(times.step, phase, times.step_ms, median, times.phases[phase], self.phases[phase].median(),
                        threshold, sum(self.flags), len(self.flags), recurring, dict(times.phases), times.own_ms,
                        sum(times.cpu_waits.values()), settings.slow_step_factor, period, len(outliers),
                        len(self.timed), tuple(outliers[-PERIOD_MIN_OUTLIERS:] if period else outliers[-8:]),
                        settings.frequency, share=share)

    def judge(self, times: StepTimes, settings: PerformanceSettings) -> SlowStep | None:
        """Judge one timed step against the history before it."""
        run = self._held_run()
        judged = times.judged_step_ms
        if len(self.steps) < MIN_HISTORY:  # a run held at a resume is decided by the threshold of before alone
            if run is None or judged <= run.base_threshold:
                return None if run is None else self._end_run(times.step, judged)
            run.add(times)
            self._hold(times.step, run)
            return None
        median = self.steps.median()
        threshold = self._threshold(settings, median)
        outlier = judged > threshold
        explained = outlier and self._explained_by_size(times, settings)
        self.flags.append(outlier and not explained)
        self.timed.append(times.step)
        if not outlier:
            ended = self._end_run(times.step, judged)
            return ended if ended is not None else self.rhythm(times, settings)
        if run is None:
            run = SlowRun(times.step, median, threshold, {phase: self.phases[phase].median() for phase in PHASES},
                          self.elements.median() if len(self.elements) else None)
        run.add(times)
        run.explained = run.explained and explained
        if explained:  # slower because larger: held, and told only if it stays (a new level, see _decide)
            if run.held is None:
                run.held = self._verdict(times, settings, median, threshold, True, None, [], None).state_dict()
            self._hold(times.step, run)
            return None
        self.outlier_steps.append(times.step)
        far = judged >= SLOW_LONE_FACTOR * median and judged - median >= FAR_MS
        if far:
            self.far_steps.append(times.step)
        flagged = sum(self.flags)
        period = self.period()
        outliers, far_recent = self._recent(self.outlier_steps), self._recent(self.far_steps)
        frequent = len(far_recent) >= FAR_MIN_OUTLIERS and len(far_recent) >= FAR_MIN_FRACTION * len(self.timed)
        recurring = flagged >= SLOW_MIN_FLAGGED or period is not None or frequent
        if recurring and period is None:
            period = self.period(PERIOD_NAMED_OUTLIERS)
        if not recurring and not (far and judged - median >= SLOW_LONE_MS):
            self._hold(times.step, run)
            return None
        share = (time_share(judged - median, smallest_period(period, settings.frequency), median)
                 if period is not None and flagged < SLOW_MIN_FLAGGED and not frequent else None)
        verdict = self._verdict(times, settings, median, threshold, recurring, period, outliers, share)
        if recurring and period is None and run.length > 1:  # slow steps in a row: a burst or a new level, held
            run.held = verdict.state_dict()
            self._hold(times.step, run)
            return None
        self._hold(times.step, run)
        return verdict

    def rhythm(self, times: StepTimes, settings: PerformanceSettings) -> SlowStep | None:
        """``times`` as the latest of ``RHYTHM_RECURRENCES`` stalls at one period and one cost, judged against the
        timed steps between them (a 30 ms write every 20th step of 1 ms steps timed every 10th: half the timed steps,
        under ``MIN_SLOW_EXCESS_MS``), with the shortest such period; None when there is none."""
        judged = times.judged_step_ms
        fastest = min(self.steps.values, default=math.inf)
        if judged < max(fastest + RHYTHM_MIN_EXCESS_MS, settings.slow_step_factor * fastest):
            return None
        timed = {recorded.step: recorded for recorded in self.history}
        timed[times.step] = times
        ms = {step: recorded.judged_step_ms for step, recorded in timed.items()}
        oldest = min(timed)
        for earlier in sorted(timed, reverse=True)[1:]:
            period = times.step - earlier
            recurrences = [times.step - j * period for j in range(RHYTHM_RECURRENCES)]
            if recurrences[-1] < oldest:
                return None
            if any(step not in timed for step in recurrences):
                continue
            between = [step for step in timed if recurrences[-1] < step < times.step and step not in recurrences]
            if not between:
                continue
            base = robust_median(ms[step] for step in between)
            excess = [ms[step] - base for step in recurrences]
            least = min(excess)
            if (least < max((settings.slow_step_factor - 1) * base, RHYTHM_MIN_EXCESS_MS)
                    or max(excess) > RHYTHM_SPREAD * least
                    or any(ms[step] > base + least / 2 for step in between)):
                continue
            share = time_share(robust_median(excess), smallest_period(period, settings.frequency), base)
            if share < MIN_PERIODIC_SHARE:
                return None
            self.outlier_steps = deque(sorted({*self.outlier_steps, *recurrences}), maxlen=RECENT_STEPS)
            excess_by_phase = {phase: times.judged(phase) - robust_median(timed[s].judged(phase) for s in between)
                               for phase in PHASES}
            phase = max(excess_by_phase, key=lambda name: excess_by_phase[name])
            return SlowStep(times.step, phase, times.step_ms, base, times.phases[phase],
                            robust_median(timed[s].phases[phase] for s in between), base + least / 2, sum(self.flags),
                            len(self.flags), True, dict(times.phases), times.own_ms, sum(times.cpu_waits.values()),
                            settings.slow_step_factor, period, RHYTHM_RECURRENCES, len(timed),
                            tuple(reversed(recurrences)), settings.frequency, share=share)
        return None

    def _held_run(self) -> SlowRun | None:
        held = self.verdicts.latest(Kind.SLOW_STEP, RUN)
        return None if held is None else SlowRun.from_state(held.measured)

    def _hold(self, step: int, run: SlowRun) -> None:
        suspicion = Suspicion(Kind.SLOW_STEP, RUN, step, bound=run.base_threshold, measured=run.state_dict())
        self.verdicts.observe(Kind.SLOW_STEP, step, [suspicion])  # confirms nothing: a run is decided when it ends

    def _end_run(self, step: int, judged_ms: float) -> SlowStep | None:
        return self._decide(self.verdicts.observe(Kind.SLOW_STEP, step, reading=judged_ms))

    def _decide(self, ended: list[Confirmed]) -> SlowStep | None:
        """An ended run of slow steps: back under the threshold of before, the burst it held; ended above it, a shift
        to a new level; still going at the end of the run, a shift that lasted to the end."""
        if not ended:
            return None
        decided = ended[0]
        run = SlowRun.from_state(decided.latest.measured)
        if run.held is None:
            return None
        held = SlowStep.from_state(run.held)
        if decided.by is ConfirmedBy.BACK_UNDER:
            return None if run.explained else held
        if decided.by is ConfirmedBy.AT_END:
            if run.explained and run.length < MIN_HISTORY:
                return None
            return replace(held, step=run.start, shift=replace(run, ended_run=True))
        self._new_level(run.start)
        return replace(held, step=run.start, shift=run)

    def _new_level(self, start: int) -> None:
        """Steps are judged against the new level only: the history before it is forgotten."""
        self.steps, self.elements = Window(RECENT_STEPS), Window(RECENT_STEPS)
        self.sized.clear()
        self.history.clear()
        self.phases = {phase: Window(RECENT_STEPS) for phase in PHASES}
        self.flags.clear()
        self.outlier_steps = deque((s for s in self.outlier_steps if s < start), maxlen=RECENT_STEPS)
        self.far_steps = deque((s for s in self.far_steps if s < start), maxlen=RECENT_STEPS)

    def flush(self) -> SlowStep | None:
        """At the end of the run: slow steps in a row still held, as a shift that lasted to the end."""
        return self._decide(self.verdicts.flush({Kind.SLOW_STEP}))

    def remember(self, times: StepTimes) -> None:
        """Add a timed step to the history, after it was judged."""
        self.steps.add(times.judged_step_ms)
        self.history.append(times)
        for phase in PHASES:
            self.phases[phase].add(times.judged(phase))
        if times.elements:
            self.elements.add(times.elements)
            self.sized.append((times.elements, times.judged_step_ms))
