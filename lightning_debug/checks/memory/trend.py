"""A robust straight line through memory readings, and whether it is growth or noise.

A leak shows as a steady rise of a byte count with the steps; a warm-up jump, an allocator's
granularity or the resident set's scatter must not read as one. The line is Theil-Sen (median of
pairwise slopes), its scatter a robust sigma and its steadiness Kendall's tau.

Example::

    >>> from lightning_debug.checks.memory.trend import fit_trend, is_steady_growth
    >>> trend = fit_trend([(step, 1000.0 + 50.0 * step) for step in range(0, 100, 10)])
    >>> round(trend.slope), trend.consistency, is_steady_growth(trend, floor=100.0)
    (50, 1.0, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.memory.readings import MB
from lightning_debug.checks.robust import MAD_TO_SIGMA, median


@dataclass(frozen=True)
class Trend:
    """A robust straight line through (step, value) readings.

    ``slope`` is the Theil-Sen estimate (median of the pairwise slopes, so a warm-up jump or an odd
    reading cannot tilt it), ``noise`` the robust scatter around the line (``MAD_TO_SIGMA`` x MAD of the
    residuals) and ``consistency`` Kendall's tau of value against step: 1.0 when every later reading
    is higher than every earlier one, about 0 for noise.
    """

    slope: float
    intercept: float
    noise: float
    consistency: float
    readings: int
    first_step: int
    last_step: int

    @property
    def growth(self) -> float:
        """What the line rises over the readings' span."""
        return self.slope * (self.last_step - self.first_step)

    def summary(self, unit: float = MB) -> dict[str, Any]:
        return {"per_step": self.slope / unit, "growth": self.growth / unit, "noise": self.noise / unit,
                "consistency": round(self.consistency, 3), "readings": self.readings,
                "first_step": self.first_step, "last_step": self.last_step}


def fit_trend(points: Sequence[tuple[int, float]]) -> Trend | None:
    """Theil-Sen slope, residual scatter and Kendall's tau of ``points``; None below 3 distinct steps.

    O(n^2) in the number of readings, which the monitor bounds (a window of a few dozen).

    Example::

        >>> trend = fit_trend([(0, 5.0), (10, 5.0), (20, 9.0), (30, 5.0), (40, 5.0)])
        >>> trend.slope, trend.consistency
        (0.0, 0.0)
    """
    if len({step for step, _ in points}) < 3:
        return None
    slopes: list[float] = []
    concordance = 0
    pairs = 0
    for i, (step_i, value_i) in enumerate(points):
        for step_j, value_j in points[i + 1:]:
            if step_j == step_i:
                continue
            slopes.append((value_j - value_i) / (step_j - step_i))
            direction = (value_j > value_i) - (value_j < value_i)
            concordance += direction if step_j > step_i else -direction
            pairs += 1
    slope = median(slopes)
    intercept = median(value - slope * step for step, value in points)
    residuals = [abs(value - intercept - slope * step) for step, value in points]
    steps = [step for step, _ in points]
    return Trend(slope=slope, intercept=intercept, noise=MAD_TO_SIGMA * median(residuals),
                 consistency=concordance / pairs, readings=len(points), first_step=min(steps),
                 last_step=max(steps))


def is_steady_growth(trend: Trend | None, floor: float, min_readings: int = 6, min_consistency: float = 0.7,
                     noise_factor: float = 4.0) -> bool:
    """Growth beyond noise: enough readings, mostly rising (Kendall's tau), and a rise over the window
    above both ``floor`` (allocator granularity, warm-up creep) and ``noise_factor`` times the scatter.

    With 6 readings a tau of 0.7 happens by chance in about 3% of noise-only windows; the floor and
    the noise test must hold as well.
    """
    return (trend is not None and trend.readings >= min_readings and trend.slope > 0
            and trend.consistency >= min_consistency and trend.growth >= max(floor, noise_factor * trend.noise))


def steps_until_exhausted(bytes_per_step: float, headroom: float) -> float:
    """How many more steps at ``bytes_per_step`` until ``headroom`` bytes are used (inf when not growing)."""
    if bytes_per_step <= 0:
        return float("inf")
    return max(0.0, headroom) / bytes_per_step
