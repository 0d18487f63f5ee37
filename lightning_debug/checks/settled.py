"""A loss that settled far above where the run started: the climb seen from its start, however noisy the way up.

The noisy-climb rule of :class:`~lightning_debug.checks.trends.LossTrend` compares the loss's level with the best
level of the run, which it counts only from the 16th loss on (the median of the first few single-example losses
can be low by luck). A learning rate far too high climbs from the first steps: by the 16th loss the level is
already high, the best level with it, and a loss that went from 2.8 to 30 in 40 steps (MobileNetV2, SGD at 0.05
with momentum) was never named. So the level (the median of the last :data:`SETTLED_WINDOW` losses) is also judged
against the run's early level, the median of its first :data:`EARLY_LOSSES` losses, which a climb has not moved
yet: :data:`SETTLED_FACTOR` times it or more is a settled climb once it holds on a few checks in a row (how many is
``loss_divergence``'s confirmation policy in the table of kinds; the monitor holds each settled check there).

What could make it fire on a healthy model, and how it is ruled out: early losses low by luck (single-example
batches, whose squared errors range over three orders of magnitude: an online regression's first three were 5x
under its level): the rise must also be :data:`SETTLED_SIGMAS` times the noise of single losses, in logarithms,
read from the steps between successive recent losses (a steady climb hardly widens them, heavy-tailed losses
make them wide); a level that passes the bar on one check (a few hard batches): it must hold for several checks in
a row (the policy); a loss that moves to a new level in one step (a change of data, see
:class:`~lightning_debug.checks.trends.LossTrend`): the early losses start again from the new level
(:meth:`SettledLevel.restart`); losses at or below 0: not judged (a ratio means nothing).

Example::

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

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_debug.checks.robust import median, robust_sigma

SETTLED_FACTOR = 5.0
"""A level this many times the early level has settled far above where the run started (issue 45: at the default
level, however noisy the climb)."""
EARLY_LOSSES = 3
"""The early level is the median of this many first losses: a learning rate far too high moves the loss from step 2."""
SETTLED_WINDOW = 8
SETTLED_SIGMAS = 5.0
"""Measured on single-example squared errors (the noisiest healthy losses): 2 runs of 1000 steps in 1000 reach 5
noise units (3 in 200 reach 4)."""


class SettledLevel:
    """The early losses of the run (or of its current data), against which a level is judged (see the module
    docstring)."""

    def __init__(self) -> None:
        self.early: list[float] = []

    @property
    def early_level(self) -> float:
        return median(self.early) if len(self.early) >= EARLY_LOSSES else float("nan")

    def judge(self, loss: float, window: Sequence[float]) -> float | None:
        """The early level when the level of ``window`` (the recent losses, ``loss`` last) is at
        :data:`SETTLED_FACTOR` times it on this check (a suspicion), else None."""
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
        """Whether ``level`` is :data:`SETTLED_SIGMAS` times the noise of single losses above the early level, in
        logarithms: the noise is read from the steps between successive recent losses (a robust spread, divided by
        the square root of 2), which a steady climb hardly moves and single-example losses make wide, and from the
        spread of the early losses themselves (three single-example losses far apart say the early level is loose)."""
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
