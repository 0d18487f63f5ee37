"""MemoryProfilerCallback: CPU and CUDA memory, leaks found and explained, OOM post-mortem."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import DebugConfig


class MemoryProfilerCallback(DebugCallback):
    """Memory on every ``memory_profiling_frequency``-th optimizer step (in development)."""

    own_fields = ("memory_profiling_frequency",)

    def __init__(
        self,
        config: DebugConfig | None = None,
        *,
        memory_profiling_frequency: int | None = None,
        log_memory: bool | None = None,
        level: str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
    ) -> None:
        super().__init__(config, memory_profiling_frequency=memory_profiling_frequency, log_memory=log_memory,
                         level=level, save_debug_info=save_debug_info, debug_output_dir=debug_output_dir)
