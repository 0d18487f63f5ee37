"""Bounded statistics: whatever the run length, memory stays constant."""

from __future__ import annotations

import math
from collections import deque
from typing import Any


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
        return {"count": self.count, "total": self.total, "minimum": self.minimum, "maximum": self.maximum,
                "last": self.last}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        self.total, self.minimum = float(state["total"]), float(state["minimum"])
        self.maximum, self.last = float(state["maximum"]), float(state["last"])


class Window:
    """The last ``size`` values, for medians and trends over recent steps."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def quantile(self, q: float) -> float:
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
