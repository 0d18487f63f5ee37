"""The one place scalars leave the plugin: batched per step, handed to a sink (a logger)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

MetricsSink = Callable[[dict[str, float], int], None]


class MetricsWriter:
    """Collects ``debug/...`` scalars per step and writes each step's dict in one sink call.

    Steps are flushed in order once the caller says no more values for them will come
    (:meth:`flush_before`), so values read back a step late still land at the step they describe.

    Example::

        >>> written = []
        >>> writer = MetricsWriter(lambda metrics, step: written.append((step, metrics)))
        >>> writer.add(3, "debug/loss_finite", 1.0); writer.add(3, "debug/anomaly/count", 0.0)
        >>> writer.flush_before(4); written
        [(3, {'debug/loss_finite': 1.0, 'debug/anomaly/count': 0.0})]
    """

    def __init__(self, sink: MetricsSink | None) -> None:
        self._sink = sink
        self._pending: dict[int, dict[str, float]] = {}
        self._failed = False

    def add(self, step: int, name: str, value: float) -> None:
        if self._sink is None or self._failed:
            return
        value = float(value)
        if math.isfinite(value):
            self._pending.setdefault(step, {})[name] = value

    def add_many(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.add(step, name, value)

    def flush_before(self, step: int | None = None) -> None:
        """Write every pending step below ``step`` (all of them when ``step`` is None)."""
        for pending_step in sorted(s for s in self._pending if step is None or s < step):
            metrics = self._pending.pop(pending_step)
            if self._sink is None or self._failed:
                continue
            try:
                self._sink(metrics, pending_step)
            except Exception as error:  # a logger failure must not stop training
                self._failed = True
                warnings.warn(f"lightning-debug could not log metrics ({type(error).__name__}: {error}); "
                              "debug scalars are no longer logged, training continues.", RuntimeWarning)
