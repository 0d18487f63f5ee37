"""PerformanceProfilerCallback: where each step's time goes, stalls found, torch.profiler on demand."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import DebugConfig


class PerformanceProfilerCallback(DebugCallback):
    """Step-phase timing on every ``performance_profiling_frequency``-th optimizer step (in development)."""

    own_fields = ("performance_profiling_frequency",)

    def __init__(
        self,
        config: DebugConfig | None = None,
        *,
        performance_profiling_frequency: int | None = None,
        log_performance: bool | None = None,
        level: str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
    ) -> None:
        super().__init__(config, performance_profiling_frequency=performance_profiling_frequency,
                         log_performance=log_performance, level=level, save_debug_info=save_debug_info,
                         debug_output_dir=debug_output_dir)
