"""The plugin's own time: how long the run spent in its own work, so step timing can leave it out.

A census, a replay or a logger call inside a step would make it look slow (a 500 ms census as a ``slow_step``),
so the performance monitor subtracts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


class OwnTime:
    """A monotone total of host time spent inside ``with own_time:`` blocks (re-entrant). :meth:`total_ms` includes
    the block in progress, so a phase boundary marked inside the plugin splits that block exactly.

        >>> own = OwnTime()
        >>> before = own.total_ms()
        >>> with own:
        ...     with own:  # nested blocks count once
        ...         time.sleep(0.01)
        >>> 9.0 <= own.total_ms() - before < 1000.0
        True
    """

    __slots__ = ("_done", "_since", "_depth", "enabled")

    def __init__(self) -> None:
        self._done = 0.0
        self._since = 0.0
        self._depth = 0
        self.enabled = False  # whether :meth:`call` counts: only when someone times steps (the performance monitor)

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)``, counted when :attr:`enabled` (the run's cheap path for every event).

            >>> own = OwnTime(); own.enabled = True
            >>> own.call(time.sleep, 0.01); own.total_ms() >= 9.0
            True
        """
        if self._depth or not self.enabled:
            return function(*args, **kwargs)
        self._depth = 1
        since = self._since = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            self._done += time.perf_counter() - since
            self._depth = 0

    def __enter__(self) -> OwnTime:
        if self._depth == 0:
            self._since = time.perf_counter()
        self._depth += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._done += time.perf_counter() - self._since

    def total_ms(self) -> float:
        """Milliseconds spent in the plugin so far, the open block included."""
        open_s = time.perf_counter() - self._since if self._depth else 0.0
        return (self._done + open_s) * 1000.0
