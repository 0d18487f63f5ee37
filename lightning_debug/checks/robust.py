"""Robust statistics, the one place that says what a level and a spread are: the median, and the median absolute
deviation scaled to a standard deviation, which ignore the outliers being looked for where a mean and a standard
deviation would be dragged by them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

# The median absolute deviation of a normal distribution times this is its standard deviation.
MAD_TO_SIGMA = 1.4826


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (NaN when empty).

    >>> median([3.0, 1.0, 2.0]), median([1.0, 2.0, 3.0, 4.0])
    (2.0, 2.5)
    """
    values = list(values)
    return statistics.median(values) if values else math.nan


def robust_sigma(values: Sequence[float], level: float | None = None) -> float:
    """The spread of ``values`` as a standard deviation estimated from their median absolute deviation around
    ``level`` (their median when None).

    >>> round(robust_sigma([1.0, 2.0, 3.0, 100.0]), 3)
    1.483
    """
    centre = median(values) if level is None else level
    return MAD_TO_SIGMA * median([abs(v - centre) for v in values])


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (NaN for no values).

    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5), quantile([5.0, 1.0, 3.0], 0.9)
    (2.5, 4.6)
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
