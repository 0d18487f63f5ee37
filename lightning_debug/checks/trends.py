"""Judging a value against the run's own recent history: robust levels, jumps and steady rises.

A fixed threshold cannot fit every model (a ResNet's gradient norm at initialisation is 60, a small MLP's 0.5),
so a value is compared with the median (level) and the robust spread of a bounded window of this run's values,
both insensitive to the outliers being looked for.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.relapses import Relapses
from lightning_debug.checks.robust import median, robust_sigma
from lightning_debug.checks.unbounded import UnboundedFall

# Gradient norm: a jump is this factor over the recent median and this many robust sigmas above it.
NORM_JUMP_FACTOR = 10.0
NORM_JUMP_SIGMAS = 6.0
NORM_WINDOW = 16
NORM_MIN_HISTORY = 3
# ... and NORM_TAIL_FACTOR times the NORM_TAIL_RANK-th largest of the last NORM_TAIL_WINDOW norms (once half there).
NORM_TAIL_WINDOW = 64
NORM_TAIL_RANK = 4
NORM_TAIL_FACTOR = 3.0
# Gradient norm: within this factor of the previous check step's norm it grew gradually.
NORM_GRADUAL_GROWTH = 3.0
# Loss: a spike is this many times the recent level and the start level, and this many times the recent maximum
# (single-example losses have a long tail).
LOSS_SPIKE_FACTOR = 10.0
LOSS_SPIKE_SIGMAS = 6.0
LOSS_WINDOW = 32
LOSS_START_VALUES = 5
SPIKE_OVER_RECENT_MAX = 2.0
# Loss: a divergence rises on most of the last DIVERGENCE_WINDOW checks, at least doubles over them, and its rise
# is DIVERGENCE_SIGMAS robust sigmas of the losses before the window (when there are that many).
DIVERGENCE_WINDOW = 8
DIVERGENCE_RISES = 6
DIVERGENCE_FACTOR = 2.0
DIVERGENCE_SIGMAS = 3.0
# Loss: a noisy climb. The level (median of the last CLIMB_LEVEL_WINDOW) is CLIMB_FACTOR times the run's best level
# and CLIMB_SIGMAS robust sigmas of single losses above it (the lowest of hundreds of noisy levels is itself an
# extreme of the noise), and higher at the last of CLIMB_CHECKS checks than at the first.
CLIMB_LEVEL_WINDOW = 8
CLIMB_FACTOR = 2.0
CLIMB_CHECKS = 4
CLIMB_SIGMAS = 6.0
REGIME_MIN_LOSSES = 4
# The best level counts from this many losses on: the spread of fewer is no measure of the noise.
CLIMB_BEST_MIN_LOSSES = 2 * CLIMB_LEVEL_WINDOW
# Loss: a level SETTLED_FACTOR times the median of the first EARLY_LOSSES losses has settled far above the start
# (a learning rate far too high moves the loss from step 2). SETTLED_SIGMAS: on single-example squared errors (the
# noisiest healthy losses) 2 runs of 1000 steps in 1000 reach 5 noise units (3 in 200 reach 4).
SETTLED_FACTOR = 5.0
EARLY_LOSSES = 3
SETTLED_WINDOW = 8
SETTLED_SIGMAS = 5.0
# Loss: an early rise. Within its first LOSS_START_VALUES checks the loss reaches LOSS_SPIKE_FACTOR times the run's
# first loss, is EARLY_RISE_FACTOR times it or more on EARLY_RISE_CHECKS checks in a row, and falls back: each of
# those checks is a spike over the losses after them (at least EARLY_RISE_AFTER), judged once the first
# EARLY_RISE_JUDGED_AT losses are known.
EARLY_RISE_FACTOR = SETTLED_FACTOR
EARLY_RISE_CHECKS = 3
EARLY_RISE_AFTER = CLIMB_LEVEL_WINDOW
EARLY_RISE_JUDGED_AT = LOSS_WINDOW


class SettledLevel:
    """The early losses of the run (or of its current data), against which a level that settled far above where
    the run started is judged, however noisy the way up.

    A learning rate far too high climbs before :class:`LossTrend`'s best level starts counting (MobileNetV2, SGD
    0.05 with momentum: 2.8 -> 30 in 40 steps). The noise is measured in logarithms (early losses low by luck);
    losses at or below 0 are not judged.

    >>> settled = SettledLevel()
    >>> climb = [2.9, 2.8, 5.1, 9.1, 8.1, 20.0, 25.0, 31.0, 28.0, 35.0, 30.0, 33.0, 29.0, 36.0, 40.0, 31.0]
    >>> verdicts = [settled.judge(loss, climb[:i + 1]) for i, loss in enumerate(climb)]
    >>> [i for i, early in enumerate(verdicts) if early is not None][:4], verdicts[-1]
    ([9, 10, 11, 12], 2.9)
    >>> noise = SettledLevel()
    >>> losses = [0.01, 0.02, 0.9] + [0.3, 1.2, 0.05, 2.0, 0.4, 0.1, 0.6, 0.2] * 4
    >>> any(noise.judge(loss, losses[:i + 1]) for i, loss in enumerate(losses))
    False
    """

    def __init__(self) -> None:
        self.early: list[float] = []

    @property
    def early_level(self) -> float:
        return median(self.early) if len(self.early) >= EARLY_LOSSES else float("nan")

    def judge(self, loss: float, window: Sequence[float]) -> float | None:
        """The early level when the level of ``window`` (the recent losses, ``loss`` last) settled above it."""
        if len(self.early) < EARLY_LOSSES:
            self.early.append(loss)
            return None
        early = self.early_level
        losses = list(window)
        recent = losses[-SETTLED_WINDOW:]
        level = median(recent) if len(recent) == SETTLED_WINDOW else float("nan")
        settled = (early > 0 and level >= SETTLED_FACTOR * early and min(losses) > 0 and min(self.early) > 0
                   and self._beyond_noise(losses, level))
        return early if settled else None

    def _beyond_noise(self, losses: Sequence[float], level: float) -> bool:
        """Whether the log level is :data:`SETTLED_SIGMAS` noise units above the early one: the noise of the steps
        between recent losses (which a steady climb hardly moves) or of the early losses themselves (three
        single-example losses far apart say the early level is loose), whichever is wider."""
        logs = [math.log(v) for v in losses]
        steps = [later - earlier for earlier, later in zip(logs, logs[1:])]
        noise = max(robust_sigma(steps) / math.sqrt(2), robust_sigma([math.log(v) for v in self.early]))
        return math.log(level) - math.log(self.early_level) >= SETTLED_SIGMAS * noise

    def restart(self, losses: Sequence[float]) -> None:
        """The data changed (the loss moved to a new level in one step): judge from ``losses``, the new level's."""
        self.early = list(losses)[:EARLY_LOSSES]

    def state_dict(self) -> dict[str, Any]:
        return {"early": list(self.early)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.early = [float(v) for v in state.get("early", [])][:EARLY_LOSSES]


@dataclass
class Rise:
    """A rise over the run's first loss within its first checks (see :class:`EarlyRise`).

    ``crossed``: the index (among the run's checked losses) of the first loss :data:`LOSS_SPIKE_FACTOR` times the
    first one; ``losses``: the rise, the checks in a row at :data:`EARLY_RISE_FACTOR` times the first loss or more
    around it; ``after``: the losses after it up to the judgement; ``limit``: the spike limit over them, which every
    loss of the rise exceeds; ``judged``: False while the run is too short to say whether it fell back.
    """

    crossed: int
    first: float
    losses: list[float]
    after: list[float]
    limit: float = math.nan
    judged: bool = False


class EarlyRise:
    """The run's first losses, against which a rise far over the first one in the first checks is judged.

    The start level the spike rule judges against is the highest of the first :data:`LOSS_START_VALUES` losses
    (single-example batches of heavy-tailed data start anywhere in their spread), so a loss that climbs over
    two or three steps takes its own rise in (Adam at lr 0.2 on a 4-class MLP: 1.40, 11.7, 20.3, 10.6, 3.48,
    0.75, ... then 0: step 1 is 8.4x the first loss, step 2 is judged against 11.7). One loss cannot say
    whether the first loss was low by chance, so the rise is judged once :data:`EARLY_RISE_JUDGED_AT` losses
    are known: it must have lasted (:data:`EARLY_RISE_CHECKS` checks in a row at :data:`EARLY_RISE_FACTOR`
    times the first loss: not one far-off batch) and fallen back so far that each of its losses is a spike over
    every loss after it (:data:`LOSS_SPIKE_FACTOR` times their median, :data:`SPIKE_OVER_RECENT_MAX` times their
    highest, :data:`LOSS_SPIKE_SIGMAS` robust spreads above their median). A first loss low by chance is not
    fallen back under: the losses after it stay at the level the rise was at. Losses below 0 are not judged.

    >>> rise = EarlyRise()
    >>> overshoot = [1.4, 11.7, 20.3, 10.6, 3.5, 0.75, 0.55, 0.3, 1.55, 0.5] + [0.4 * 0.8 ** i for i in range(22)]
    >>> found = [rise.judge(loss) for loss in overshoot]
    >>> [i for i, r in enumerate(found) if r is not None and not r.judged][:2], found[-1].crossed, found[-1].losses
    ([2, 3], 2, [11.7, 20.3, 10.6])
    >>> low_by_chance = EarlyRise()
    >>> [low_by_chance.judge(loss) for loss in [0.01] + [0.5, 0.8, 0.3, 1.2] * 8][-1] is None
    True
    """

    def __init__(self) -> None:
        self.first: list[float] = []

    def judge(self, loss: float) -> Rise | None:
        """A rise suspected (``judged`` False) until the first :data:`EARLY_RISE_JUDGED_AT` losses are known, then
        the rise if it fell back (``judged``), else None; None on every later check."""
        if len(self.first) >= EARLY_RISE_JUDGED_AT:
            return None
        self.first.append(loss)
        first = self.first
        if not first[0] > 0 or min(first) < 0:
            return None
        crossed = next((i for i, value in enumerate(first[1:LOSS_START_VALUES], 1)
                        if value >= LOSS_SPIKE_FACTOR * first[0]), None)
        if crossed is None:
            return None
        if len(first) < EARLY_RISE_JUDGED_AT:
            return Rise(crossed, first[0], [], [])
        far = EARLY_RISE_FACTOR * first[0]
        begin, end = crossed, crossed + 1
        while begin > 1 and first[begin - 1] >= far:
            begin -= 1
        while end < len(first) and first[end] >= far:
            end += 1
        risen, after = first[begin:end], first[end:]
        if len(risen) < EARLY_RISE_CHECKS or len(after) < EARLY_RISE_AFTER:
            return None
        level = median(after)
        limit = max(LOSS_SPIKE_FACTOR * level, SPIKE_OVER_RECENT_MAX * max(after),
                    level + LOSS_SPIKE_SIGMAS * robust_sigma(after))
        if min(risen) <= limit:
            return None
        return Rise(crossed, first[0], risen, after, limit, judged=True)

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first = [float(v) for v in state.get("first", [])][:EARLY_RISE_JUDGED_AT]


def jump_limit(history: Sequence[float], factor: float, sigmas: float, minimum: int) -> float | None:
    """The value above which a new value is a jump over ``history``: ``factor`` times its median or ``sigmas``
    robust standard deviations above it, whichever is higher; None with fewer than ``minimum`` values.

    >>> jump_limit([1.0, 1.2, 0.8], factor=10, sigmas=6, minimum=3), jump_limit([1.0], 10, 6, 3)
    (10.0, None)
    """
    finite = [v for v in history if math.isfinite(v)]
    if len(finite) < minimum:
        return None
    level = median(finite)
    return max(factor * level, level + sigmas * robust_sigma(finite))


class NormHistory:
    """The recent global gradient norms of check steps, for judging the next one (see :func:`jump_limit`).

    Every finite, non-zero norm enters the window, flagged or not: an explosion is reported when it starts, and a
    level that stays becomes the new normal. The tail limit exists because a fine-tuned classifier's hard examples
    reach 10-170x the median on one check step in ten (docs/gradients.md). A zero norm (a margin loss at 0) says
    nothing about the scale; ``last`` keeps the previous norm whatever it was, so a norm that turns non-finite is
    told apart.

    >>> history = NormHistory()
    >>> for norm in (60.0, 58.0, 61.0): history.add(norm)
    >>> history.limit()
    600.0
    """

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=NORM_WINDOW)
        self.losses: deque[float] = deque(maxlen=NORM_WINDOW)  # the loss of each of ``values`` (nan: not known)
        self.tail: deque[float] = deque(maxlen=NORM_TAIL_WINDOW)
        self.start_losses: list[float] = []
        self.last = math.nan

    @property
    def first_loss(self) -> float:
        """The run's first finite checked loss (NaN: none yet)."""
        return self.start_losses[0] if self.start_losses else math.nan

    @property
    def last_loss(self) -> float:
        """The loss of the latest check step kept (NaN: none, or not known)."""
        return self.losses[-1] if self.losses else math.nan

    def limit(self) -> float | None:
        limit = jump_limit(self.values, NORM_JUMP_FACTOR, NORM_JUMP_SIGMAS, NORM_MIN_HISTORY)
        routine = self.routine()
        return limit if limit is None or routine is None else max(limit, NORM_TAIL_FACTOR * routine)

    def routine(self) -> float | None:
        """The norm this run reaches on one check step in 16 lately (None with under half the tail window).

        >>> history = NormHistory()
        >>> for step in range(40): history.add(12.0 if step % 8 == 0 else 0.3)
        >>> history.routine(), history.limit()
        (12.0, 36.0)
        """
        if len(self.tail) < NORM_TAIL_WINDOW // 2:
            return None
        return heapq.nlargest(NORM_TAIL_RANK, self.tail)[-1]

    def level(self) -> float:
        return median(self.values)

    def add(self, norm: float, loss: float = math.nan) -> None:
        """This check step's global norm and loss (the first finite losses are where the run started)."""
        self.last = norm
        if math.isfinite(norm) and norm > 0:
            self.values.append(norm)
            self.losses.append(loss)
            self.tail.append(norm)
        if math.isfinite(loss) and len(self.start_losses) < LOSS_START_VALUES:
            self.start_losses.append(loss)

    def grew_while_learning(self, norm: float, loss: float) -> bool:
        """Whether ``norm`` grew gradually while the loss stayed below where the run started: a norm rising out
        of its initialisation, not a departure from a level.

        >>> history = NormHistory()
        >>> for norm, loss in ((1.0, 13.0), (2.1, 11.6), (10.1, 14.8)): history.add(norm, loss)
        >>> history.grew_while_learning(22.4, 6.0), history.grew_while_learning(22.4, 21.0), history.grew_while_learning(45.0, 6.0)
        (True, False, False)
        """
        if not self.values or not self.start_losses or not math.isfinite(loss):
            return False
        return norm <= NORM_GRADUAL_GROWTH * self.values[-1] and loss <= max(self.start_losses)

    def load(self, values: Iterable[float], start_losses: Iterable[float] = (), losses: Iterable[float] = ()) -> None:
        self.values.clear()
        self.losses.clear()
        self.tail.clear()
        values, losses = list(values), list(losses)
        losses = [math.nan] * (len(values) - len(losses)) + losses[-len(values):] if values else []
        for value, loss in zip(values, losses):
            self.add(float(value), float(loss))
        self.last = self.values[-1] if self.values else math.nan
        self.start_losses = [float(loss) for loss in start_losses][:LOSS_START_VALUES]


class LossKind(str, enum.Enum):
    """What a loss shows against the run's history (see :class:`LossTrend`)."""

    SPIKE = "spike"
    DIVERGENCE = "divergence"
    CLIMB = "climb"
    SETTLED = "settled"
    OSCILLATING = "oscillating"
    EARLY_RISE = "early_rise"
    UNBOUNDED_FALL = "unbounded_fall"
    OUTLIER = "outlier"


@dataclass
class LossVerdict:
    """What one check step's loss shows: a :class:`LossKind` (or None for nothing), with the numbers.

    ``next_loss``: a spike's or an outlier's next check loss, which settled it; ``step`` and ``where``: the check
    step the verdict is about (for those two, the check before the one that returned it); ``peaks``: for
    ``oscillating``, the highest loss of each of the last relapses; ``first_loss`` and ``rise``: for ``early_rise``,
    the run's first loss and the losses of the rise (``loss`` is the one that crossed, ``level`` that of the losses
    after it, ``limit`` the spike limit over them).
    """

    kind: LossKind | None
    loss: float
    level: float = math.nan
    start: float = math.nan
    limit: float = math.nan
    window: list[float] | None = None
    best: float = math.nan
    early: float = math.nan
    next_loss: float | None = None
    step: int | None = None
    where: dict[str, Any] | None = None
    peaks: list[float] | None = None
    first_loss: float = math.nan
    rise: list[float] | None = None
    fall: dict[str, Any] | None = None

    def measured(self) -> dict[str, Any]:
        """The numbers, as plain values (what travels with a held suspicion and in a checkpoint)."""
        return {"loss": self.loss, "level": self.level, "start": self.start, "limit": self.limit,
                "window": None if self.window is None else list(self.window), "best": self.best, "early": self.early}

    @property
    def details(self) -> dict[str, Any]:
        optional = (("next_loss", self.next_loss, self.next_loss is not None),
                    ("limit", self.limit, math.isfinite(self.limit)), ("recent_losses", self.window, bool(self.window)),
                    ("best_level", self.best, math.isfinite(self.best)),
                    ("early_level", self.early, math.isfinite(self.early)),
                    ("relapse_peaks", self.peaks, bool(self.peaks)),
                    ("first_loss", self.first_loss, math.isfinite(self.first_loss)),
                    ("rise_losses", self.rise, bool(self.rise)))
        fall = self.fall or {}
        return {"loss": self.loss, "recent_level": self.level, "start_level": self.start,
                **{key: value for key, value, shown in optional if shown}, **fall}


@dataclass
class LossReading:
    """What one check step's loss suggests; how long a suspicion is held is its kind's policy.

    ``rising``: the climb's level is higher than at the first of the last ``climb_checks`` checks it was;
    ``levels_judged``: whether the level was judged at all (a check that did not neither continues nor ends a climb);
    ``rise_suspected``: a rise over the first loss in the first checks waits for the judgement ``early_rise`` holds.
    """

    loss: float
    spike: LossVerdict | None = None
    divergence: LossVerdict | None = None
    climb: LossVerdict | None = None
    rising: bool = False
    settled: LossVerdict | None = None
    levels_judged: bool = False
    oscillating: LossVerdict | None = None
    early_rise: LossVerdict | None = None
    rise_suspected: bool = False
    fall: LossVerdict | None = None


class LossTrend:
    """The loss of recent check steps and the baselines a new loss is judged against; it holds no suspicion.

    ``judge`` says what a loss suggests: a ``spike``, a steady ``divergence``, a noisy ``climb`` of the level over
    the run's best level, a ``settled`` climb over the early level (:class:`SettledLevel`), an ``oscillating``
    loss (:class:`~lightning_debug.checks.relapses.Relapses`) or an ``early_rise`` over the first loss that fell back
    (:class:`EarlyRise`). What each rules out on healthy runs (one far-off
    batch, a warm-up bump, stationary noise, a change of data) is in docs/gradients.md, "Early divergence".

    >>> trend = LossTrend()
    >>> readings = [trend.judge(v) for v in (6.9, 7857.0, 9000.0)]
    >>> [r.spike is not None for r in readings], readings[1].spike.limit
    ([False, True, False], 69.0)
    >>> LossTrend().judge(math.nan).levels_judged
    False
    """

    def __init__(self, climb_checks: int = CLIMB_CHECKS) -> None:
        self.recent: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.start: list[float] = []
        self.best_level = math.inf
        self._best_spread: float | tuple[float, ...] = 0.0  # the losses at the best level until their spread is asked
        self.climb_levels: deque[float] = deque(maxlen=max(climb_checks, 1))
        """The levels of the last checks above the climb limit (the verdict engine holds the streak)."""
        self.far_above = SettledLevel()
        self.relapses = Relapses()
        self.early_rise = EarlyRise()
        self.unbounded = UnboundedFall()

    @property
    def best_spread(self) -> float:
        """The robust spread of single losses at the best level, worked out when first needed (a healthy loss
        reaches a new best level on most steps, and a climb is judged on few)."""
        if isinstance(self._best_spread, tuple):
            self._best_spread = robust_sigma(self._best_spread)
        return self._best_spread

    @property
    def start_level(self) -> float:
        """Where the run started: the highest of its first losses (NaN before any)."""
        return max(self.start) if self.start else math.nan

    def judge(self, loss: float, climb: bool = True) -> LossReading:
        """What ``loss`` suggests; ``climb=False`` leaves out the level's judgements (several optimizers). A
        non-finite loss is not judged and not remembered."""
        if not math.isfinite(loss):
            return LossReading(loss)
        divergence = self._divergence(loss)
        spike = self._spike(loss) if divergence is None else None
        oscillating = self._oscillating(loss) if climb else None
        self.recent.append(loss)
        if len(self.start) < LOSS_START_VALUES:
            self.start.append(loss)
        level = self._level()
        settled = self._settled(loss, level) if climb else None
        climbing, rising = self._climb(loss, level) if climb else (None, False)
        rise = self.early_rise.judge(loss) if climb else None
        fall = self._fall(loss) if climb else None
        if math.isfinite(level) and level < self.best_level and len(self.recent) >= CLIMB_BEST_MIN_LOSSES:
            self.best_level = level
            self._best_spread = tuple(self.recent)
        return LossReading(loss, spike, divergence, climbing, rising, settled, climb, oscillating,
                           self._rise_verdict(rise), rise is not None, fall)

    def _fall(self, loss: float) -> LossVerdict | None:
        fall = self.unbounded.judge(loss, self.recent, self.start)
        if fall is None:
            return None
        return LossVerdict(LossKind.UNBOUNDED_FALL, loss, fall.level, self.start_level, window=fall.window,
                           fall=fall.details)

    def _rise_verdict(self, rise: Rise | None) -> LossVerdict | None:
        if rise is None or not rise.judged:
            return None
        first = self.early_rise.first
        return LossVerdict(LossKind.EARLY_RISE, first[rise.crossed], median(rise.after), self.start_level, rise.limit,
                           first[:rise.crossed + 1], first_loss=rise.first, rise=rise.losses)

    def _oscillating(self, loss: float) -> LossVerdict | None:
        peaks = self.relapses.judge(loss, self.recent, self.start_level)
        if peaks is None:
            return None
        return LossVerdict(LossKind.OSCILLATING, loss, median(self.recent), self.start_level,
                           window=list(self.recent)[-DIVERGENCE_WINDOW:], peaks=peaks)

    def _settled(self, loss: float, level: float) -> LossVerdict | None:
        early = self.far_above.judge(loss, self.recent)
        cut = self._new_level_at() if early is not None else None
        if cut is not None:  # a change of data, not a climb: judged from the new level's first losses
            self.far_above.restart(list(self.recent)[cut:])
            return None
        if early is None:
            return None
        return LossVerdict(LossKind.SETTLED, loss, level, self.start_level, SETTLED_FACTOR * early,
                           list(self.recent)[-CLIMB_LEVEL_WINDOW:], early=early)

    def _level(self) -> float:
        if len(self.recent) < CLIMB_LEVEL_WINDOW:
            return math.nan
        return median(list(self.recent)[-CLIMB_LEVEL_WINDOW:])

    def _climb(self, loss: float, level: float) -> tuple[LossVerdict | None, bool]:
        """The level above the climb limit on this check (or None), and whether it is rising."""
        start = self.start_level
        above = (math.isfinite(level) and 0 < self.best_level < math.inf and level > start > 0
                 and level >= self._climb_limit())
        if not above:
            return None, False
        jump = self._new_level_at()
        if jump is not None:  # a change of data, not an overshoot: judged from the new level on
            for _ in range(jump):
                self.recent.popleft()
            self.best_level, self._best_spread = math.inf, 0.0
            self.climb_levels.clear()
            self.far_above.restart(self.recent)
            return None, False
        self.climb_levels.append(level)
        levels = self.climb_levels
        rising = len(levels) == levels.maxlen and levels[-1] > levels[0]
        return LossVerdict(LossKind.CLIMB, loss, level, start, self._climb_limit(),
                           list(self.recent)[-CLIMB_LEVEL_WINDOW:], self.best_level), rising

    def _new_level_at(self) -> int | None:
        """Where in ``recent`` the losses split into a lower and a higher level with a gap between (None: nowhere)."""
        recent = list(self.recent)[-2 * CLIMB_LEVEL_WINDOW:]
        offset = len(self.recent) - len(recent)
        for cut in range(REGIME_MIN_LOSSES, len(recent) - REGIME_MIN_LOSSES + 1):
            before, after = recent[:cut], recent[cut:]
            if min(after) >= CLIMB_FACTOR * max(before):
                return offset + cut
        return None

    def _climb_limit(self) -> float:
        return max(CLIMB_FACTOR * self.best_level, self.best_level + CLIMB_SIGMAS * self.best_spread)

    def _spike(self, loss: float) -> LossVerdict | None:
        if not self.recent or loss <= 0:
            return None
        start = self.start_level
        if start <= 0 or loss <= LOSS_SPIKE_FACTOR * start:  # below the lowest limit there can be: no median needed
            return None
        level = median(self.recent)
        if level <= 0:
            return None
        limit = max(LOSS_SPIKE_FACTOR * max(level, start), SPIKE_OVER_RECENT_MAX * max(self.recent))
        if len(self.recent) >= LOSS_START_VALUES:
            limit = max(limit, level + LOSS_SPIKE_SIGMAS * robust_sigma(self.recent))
        if loss <= limit:
            return None
        return LossVerdict(LossKind.SPIKE, loss, level, start, limit, list(self.recent)[-DIVERGENCE_WINDOW:])

    def _divergence(self, loss: float) -> LossVerdict | None:
        start = self.start_level
        if not loss > start:  # at or below where the run started (or no start yet): no divergence
            return None
        window = [*list(self.recent)[-(DIVERGENCE_WINDOW - 1):], loss]
        if len(window) < DIVERGENCE_WINDOW or window[0] <= 0:
            return None
        rises = sum(later > earlier for earlier, later in zip(window, window[1:]))
        half = DIVERGENCE_WINDOW // 2
        first, last = window[:half], window[half:]
        steady = min(last) > max(first) and median(last) >= DIVERGENCE_FACTOR * median(first)
        if steady and len(self.recent) >= 2 * DIVERGENCE_WINDOW - 1:  # DIVERGENCE_WINDOW losses before the window
            before = list(self.recent)[:-(DIVERGENCE_WINDOW - 1)]
            steady = median(last) - median(first) >= DIVERGENCE_SIGMAS * robust_sigma(before)
        if rises < DIVERGENCE_RISES or not steady or loss < DIVERGENCE_FACTOR * window[0]:
            return None
        return LossVerdict(LossKind.DIVERGENCE, loss, median(self.recent), start, DIVERGENCE_FACTOR * window[0], window)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "start": list(self.start), "best_level": self.best_level,
                "best_spread": self.best_spread, "climb_levels": list(self.climb_levels),
                "far_above": self.far_above.state_dict(), "relapses": self.relapses.state_dict(),
                "early_rise": self.early_rise.state_dict(), "unbounded": self.unbounded.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(float(v) for v in state.get("recent", []))
        self.start = [float(v) for v in state.get("start", [])][:LOSS_START_VALUES]
        self.best_level = float(state.get("best_level", math.inf))
        self._best_spread = float(state.get("best_spread", 0.0))
        self.climb_levels.clear()
        self.climb_levels.extend(float(v) for v in state.get("climb_levels", []))
        self.far_above.load_state_dict(state.get("far_above", {}))
        self.relapses.load_state_dict(state.get("relapses", {}))
        self.early_rise.load_state_dict(state.get("early_rise", {}))
        self.unbounded.load_state_dict(state.get("unbounded", {}))
