"""A loss that falls without bound: below zero, ever further, at least in proportion to the steps.

Every loss a model can be trained to minimise is bounded below: a cross-entropy or a squared error by 0, a negative
cosine similarity or Dice by -1, a continuous negative log-likelihood by what float32 can resolve (a per-dimension
log-density of about 16 to 87 nats). A loss that keeps falling has nothing to converge to: ``nll_loss`` fed raw
logits instead of log-probabilities (-logit of the target, which the optimizer pushes to -inf), a maximised quantity
with no ceiling, a sign flipped on a term that grows. Such a loss looks like fast progress, so no rule that waits for
a rise sees it.

What tells it from a negative loss converging is the shape of its whole history, not one value: a bounded loss levels
off, so the ratio of its levels as the run doubles tends to 1; an unbounded one grows in magnitude each time the run
doubles (:data:`FALL_OCTAVE_FACTOR`: it falls like ``-c * n ** a`` with ``a >= 1``, a fixed step on ever-growing
logits, weights moving linearly). The level is also judged against the magnitude of the run's first losses
(:data:`FALL_FACTOR` times it: a loss bounded by -1 that starts at a random cosine, about 0.03, cannot get there).
The history kept is one level per doubling of the run (a few dozen numbers for any run length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.robust import median

FALL_FACTOR = 1000.0
"""The level is at least this many times the largest magnitude among the run's first losses."""
FALL_OCTAVE_FACTOR = 1.5
"""Its magnitude grew at least this much over each of the last two doublings of the run (a line with an offset,
``-(c + k * n)``, grows a little under 2x)."""
FALL_LEVEL_WINDOW = 8
"""The level: the median of this many checked losses."""
FALL_FIRST_OCTAVE = 16
"""The first check whose level is kept: the ladder is the levels at checks 16, 32, 64, ... (judged from check 64)."""


@dataclass
class Fall:
    """A level that fell without bound: ``level`` now, ``start`` the largest magnitude of the first losses, and the
    ladder's levels the growth was judged over (``earlier`` at check ``earlier_at``, ``before`` at ``before_at``)."""

    level: float
    start: float
    before: float
    before_at: int
    earlier: float
    earlier_at: int
    window: list[float]

    @property
    def details(self) -> dict[str, Any]:
        return {"start_magnitude": self.start, "level_at_check": {self.earlier_at: self.earlier,
                                                                  self.before_at: self.before}}


class UnboundedFall:
    """The levels of the loss at each doubling of the run, against which a level below zero is judged.

    >>> falling = UnboundedFall()
    >>> losses = [0.09, -0.06, -0.2, -0.3, -0.5] + [-0.002 * n ** 3 for n in range(5, 200)]
    >>> found = [falling.judge(loss, losses[max(0, i - 7):i + 1], losses[:5]) for i, loss in enumerate(losses)]
    >>> first = next(i for i, fall in enumerate(found) if fall is not None)
    >>> first, round(found[first].level), (found[first].earlier_at, found[first].before_at)
    (67, -512, (16, 32))
    >>> converging = UnboundedFall()  # a negative cosine similarity from a random start: it levels off at -1
    >>> cosine = [-0.03 - 0.97 * (1 - 0.97 ** n) for n in range(400)]
    >>> any(converging.judge(loss, cosine[max(0, i - 7):i + 1], cosine[:5]) for i, loss in enumerate(cosine))
    False
    """

    def __init__(self) -> None:
        self.count = 0
        self.ladder: dict[int, float] = {}

    def judge(self, loss: float, window: Sequence[float], start: Sequence[float]) -> Fall | None:
        """The fall, when the level of ``window`` (the recent checked losses, ``loss`` last) fell without bound;
        ``start``: the run's first checked losses, whose largest magnitude is the scale it is judged against."""
        self.count += 1
        recent = list(window)[-FALL_LEVEL_WINDOW:]
        if len(recent) < FALL_LEVEL_WINDOW:
            return None
        level, count = median(recent), self.count
        if count >= FALL_FIRST_OCTAVE and count & (count - 1) == 0:
            self.ladder[count] = level
        before_at = 1 << max((count // 2).bit_length() - 1, 0)  # the last doubling at or before half the run
        earlier_at = before_at // 2
        if earlier_at not in self.ladder or before_at not in self.ladder:
            return None
        before, earlier = self.ladder[before_at], self.ladder[earlier_at]
        scale = max(abs(value) for value in start)
        fell = (earlier < 0 and before <= FALL_OCTAVE_FACTOR * earlier and level <= FALL_OCTAVE_FACTOR * before
                and -level >= FALL_FACTOR * scale)
        if not fell:
            return None
        return Fall(level, scale, before, before_at, earlier, earlier_at, recent)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "ladder": {str(k): v for k, v in self.ladder.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("count", 0))
        self.ladder = {int(k): float(v) for k, v in dict(state.get("ladder", {})).items()}


def fallen_far(window: Sequence[float], start: Sequence[float]) -> tuple[float, float] | None:
    """The last loss of ``window`` and the scale of ``start`` (the largest magnitude of the run's first losses) when
    that loss lies :data:`FALL_FACTOR` times the scale below 0: a fall no bounded loss makes. Read once the run has
    gone non-finite, when no later loss can show the fall's shape::

        >>> fallen_far([0.61, -4e3, -2.6e22], [0.61, 0.6])
        (-2.6e+22, 0.61)
        >>> fallen_far([0.03, -0.99], [0.03]) is None, fallen_far([], [0.5]) is None  # a cosine loss bounded by -1
        (True, True)
    """
    if not window or not start:
        return None
    last, scale = window[-1], max(abs(value) for value in start)
    return (last, scale) if scale > 0 and -last >= FALL_FACTOR * scale else None

