"""How often each parameter (or layer) was flagged by a rule, for the report's ``most_flagged``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FLAGGED_KEPT = 200


class FlagCounter:
    """How often each parameter was flagged, bounded: past ``limit`` names the rarest are dropped.

    Example::

        >>> counter = FlagCounter(limit=4)
        >>> counter.add(["a", "b"]); counter.add(["a"]); counter.top(1)
        [['a', 2]]
    """

    def __init__(self, limit: int = FLAGGED_KEPT) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def add(self, names: Iterable[str]) -> None:
        for name in names:
            self.counts[name] = self.counts.get(name, 0) + 1
        if len(self.counts) > self.limit:
            kept = sorted(self.counts.items(), key=lambda item: -item[1])[:self.limit // 2]
            self.counts = dict(kept)

    def top(self, count: int) -> list[list[Any]]:
        ordered = sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))
        return [[name, hits] for name, hits in ordered[:count]]
