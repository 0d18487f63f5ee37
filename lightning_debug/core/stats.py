"""Bounded statistics: whatever the run length, memory stays constant."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

from lightning_debug.checks.robust import quantile


class RunningStats:
    """Count, mean, min, max and last value of a stream, in O(1) memory.

    Example::

        >>> stats = RunningStats()
        >>> for value in (1.0, 3.0, float("nan")):
        ...     stats.add(value)
        >>> stats.summary()
        {'count': 2, 'mean': 2.0, 'min': 1.0, 'max': 3.0, 'last': 3.0}
    """

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.minimum = math.inf
        self.maximum = -math.inf
        self.last = math.nan

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.count += 1
        self.total += value
        self.minimum = min(self.minimum, value)
        self.maximum = max(self.maximum, value)
        self.last = value

    def summary(self) -> dict[str, Any]:
        if not self.count:
            return {"count": 0}
        return {"count": self.count, "mean": self.total / self.count, "min": self.minimum,
                "max": self.maximum, "last": self.last}

    def state_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in ("count", "total", "minimum", "maximum", "last")}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        for name in ("total", "minimum", "maximum", "last"):
            setattr(self, name, float(state[name]))


class Reservoir:
    """A uniform sample of a stream in bounded memory (Vitter's algorithm R), for run-wide quantiles.

    Example::

        >>> reservoir = Reservoir(size=100)
        >>> for value in range(10_000):
        ...     reservoir.add(float(value))
        >>> len(reservoir.values), 3000 < reservoir.quantile(0.5) < 7000
        (100, True)
    """

    def __init__(self, size: int = 1024, seed: int = 0) -> None:
        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self._random.randrange(self.seen)
            if slot < self.size:
                self.values[slot] = value

    def quantile(self, q: float) -> float:
        return quantile(self.values, q)


class DistributionStats(RunningStats):
    """:class:`RunningStats` plus median and p90 from a bounded :class:`Reservoir` sample.

    Example::

        >>> stats = DistributionStats()
        >>> for value in (1.0, 2.0, 3.0, 4.0):
        ...     stats.add(value)
        >>> stats.summary()["median"], stats.summary()["max"]
        (2.5, 4.0)
    """

    def __init__(self) -> None:
        super().__init__()
        self.reservoir = Reservoir()

    def add(self, value: float) -> None:
        super().add(value)
        self.reservoir.add(value)

    def summary(self) -> dict[str, Any]:
        summary = super().summary()
        if self.count:
            summary.update(median=self.reservoir.quantile(0.5), p90=self.reservoir.quantile(0.9))
        return summary


class Window:
    """The last ``size`` finite values, for medians and trends over recent steps."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        return quantile(self.values, 0.5)

    def quantile(self, q: float) -> float:
        return quantile(self.values, q)
