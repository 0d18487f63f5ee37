"""PerformanceProfilerCallback: where each step's time goes, stalls found, torch.profiler on demand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.kinds import with_kinds
from lightning_debug.core.monitor import Monitor
from lightning_debug.monitors import AREA_SPECS


class PerformanceProfilerCallback(DebugCallback):
    """Time the phases of every ``performance_profiling_frequency``-th optimizer step and find stalls.

    Each check step is split into data wait, forward, backward and optimizer step (summed over micro-batches),
    logged as ``debug/perf/*_ms`` with ``debug/perf/samples_per_sec`` (and ``tokens_per_sec`` given a
    ``tokens_fn``). On CUDA the boundaries are CUDA events read once completed, so nothing waits for the GPU;
    on CPU they are wall-clock times. Other steps cost an integer comparison per hook. The plugin's own work
    (checks, census, replays, logging) and, on CPU, waits for a CPU another program had are not held against
    the step.

    A slow step is a robust outlier that recurs, reported with the slow phase; a data wait with the loader's
    ``num_workers``, ``pin_memory``, ``persistent_workers`` and what to change; under DDP per-rank times are
    gathered on check steps; at ``level=EXPERT`` on CUDA a short ``torch.cuda.set_sync_debug_mode("warn")``
    window names the lines that forced host-device synchronizations.

    ``profile_steps=(start, length)`` (a default window from ``level=ADVANCED``) runs ``torch.profiler`` over
    those steps, writes ``profiler/rank0.steps<a>-<b>.pt.trace.json`` under the debug output directory
    (Perfetto, chrome://tracing, TensorBoard), records an event and adds the top operators to report.md.
    Steps inside the profiler or sync-debug windows are left out of the statistics.

    Args:
        batch_size_fn: ``batch -> samples`` when dimension 0 of the batch's first tensor is not it.
        tokens_fn: ``batch -> tokens``, to log ``debug/perf/tokens_per_sec``.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import PerformanceProfilerCallback
        >>> callback = PerformanceProfilerCallback(performance_profiling_frequency=5, profile_steps=(10, 3),
        ...                                        tokens_fn=lambda batch: batch["input_ids"].numel())
        >>> trainer = pl.Trainer(callbacks=[callback], max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.PERFORMANCE

    def __init__(self, config: DebugConfig | None = None, *, batch_size_fn: Callable[[Any], int] | None = None,
                 tokens_fn: Callable[[Any], int] | None = None, **overrides: Any) -> None:
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        super().__init__(config, **overrides)

    def make_monitor(self) -> Monitor:
        return AREA_SPECS[self.area].build(self.config, type(self).__name__, batch_size_fn=self.batch_size_fn,
                                           tokens_fn=self.tokens_fn)


PerformanceProfilerCallback.__doc__ = with_kinds(PerformanceProfilerCallback.__doc__, (Area.PERFORMANCE,))
