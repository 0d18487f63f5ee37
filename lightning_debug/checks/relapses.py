"""An oscillating loss: one that jumps back to where the run started, again and again, and each time comes back
down (AutoTrainer's "oscillating loss": a learning rate just past the stable step size). No single jump need be a
spike and no level climbs, so it is told from a healthy loss's noise by a pattern over many checks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from lightning_debug.checks.robust import median, robust_sigma

RELAPSE_FACTOR = 2.0
RELAPSE_SIGMAS = 3.5
"""A relapse is at least :data:`RELAPSE_FACTOR` times the recent level and this many robust spreads above it, in
logarithms: a heavy-tailed loss (single-example squared errors, log spread about 2) moves 20-50x over its level
without one; at 3 a stationary log-normal loss (spread 0.5) had 5 such jumps within 96 of 3,000 checks."""
RELAPSE_MIN_HISTORY = 16
"""Losses before a relapse can be judged: the spread of fewer is no measure of their noise."""
RELAPSES = 5
RELAPSE_WINDOW = 96
"""The loss oscillates while :data:`RELAPSES` relapses that came back down lie within this many checks."""
TINY = 1.1754943508222875e-38
"""A loss of exactly 0 (a classifier that fits its batch to float32 precision) is float32's smallest normal number
in logarithms."""


class Relapses:
    """The relapses of the loss that came back down, over the last :data:`RELAPSE_WINDOW` checks.

    A relapse reaches the level the run started at (the untrained model's loss) and the bound over the median of
    the recent losses; consecutive relapses are one, counted once the loss is back under that bound (a loss that
    moves to a new level, a curriculum's next stage, never comes back). Judged only when every recent loss is at
    or above 0 (a ratio of signed losses means nothing). A healthy loss's far-off batch relapses once in a while,
    not one check in 20; a warm-up bump comes back once; a converged loss's hard batch never reaches the untrained
    loss. Many bad records (one single-example batch in 20 or more) read the same; the finding says so.

    >>> relapses = Relapses()
    >>> losses = [1.4, 1.7, 1.8, 1.3, 1.0] + [0.0] * 20 + ([0.0] * 8 + [5.0]) * 6
    >>> found = [relapses.judge(loss, losses[max(0, i - 32):i], 1.8) for i, loss in enumerate(losses)]
    >>> [i for i, peaks in enumerate(found) if peaks][:2], found[-1]
    ([70, 71], [5.0, 5.0, 5.0, 5.0, 5.0])
    >>> noise = Relapses()
    >>> import random
    >>> rng = random.Random(0)
    >>> chi2 = [rng.gauss(0, 1) ** 2 for _ in range(1000)]
    >>> any(noise.judge(loss, chi2[max(0, i - 32):i], max(chi2[:5])) for i, loss in enumerate(chi2))
    False
    """

    def __init__(self) -> None:
        self.checks = 0  # losses judged so far: the window's clock
        self.open: tuple[int, float, float] | None = None  # the relapse under way: first check, bound, peak
        self.back: deque[tuple[int, float]] = deque(maxlen=RELAPSES)  # those that came back: first check, peak

    def judge(self, loss: float, recent: Sequence[float], start: float) -> list[float] | None:
        """The peaks of the last :data:`RELAPSES` relapses when the loss oscillates, else None. ``recent``: the
        losses before ``loss``; ``start``: the level the run started at."""
        if not math.isfinite(loss):
            return None
        self.checks += 1
        if self.open is not None:
            first, limit, peak = self.open
            if loss >= limit:
                self.open = (first, limit, max(peak, loss))
            else:
                self.back.append((first, peak))
                self.open = None
        elif loss >= start and (bound := self._bound(recent, start)) is not None and loss >= bound:
            self.open = (self.checks, bound, loss)  # the bound is worked out only for a loss over the start
        full = len(self.back) == RELAPSES and self.checks - self.back[0][0] < RELAPSE_WINDOW
        return [peak for _, peak in self.back] if full else None

    @staticmethod
    def _bound(recent: Sequence[float], start: float) -> float | None:
        """What a loss must reach to be a relapse (None: not judged)."""
        if len(recent) < RELAPSE_MIN_HISTORY or not start > 0 or min(recent) < 0:
            return None
        logs = [math.log(max(value, TINY)) for value in recent]
        level = median(logs)
        margin = max(RELAPSE_SIGMAS * robust_sigma(logs), math.log(RELAPSE_FACTOR))
        return max(start, math.exp(min(level + margin, 709.0)))

    def state_dict(self) -> dict[str, Any]:
        return {"checks": self.checks, "open": None if self.open is None else list(self.open),
                "back": [list(item) for item in self.back]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = int(state.get("checks", 0))
        opened = state.get("open")
        self.open = None if opened is None else (int(opened[0]), float(opened[1]), float(opened[2]))
        self.back.clear()
        self.back.extend((int(first), float(peak)) for first, peak in state.get("back", []))
