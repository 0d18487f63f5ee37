"""The performance area's settings, typed and frozen, made once from the user's flat ``DebugConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_debug.config import DebugConfig, DebugLevel, config_value, read_view

# The torch.profiler window (start, length) from level ADVANCED without ``profile_steps``: two recorded steps
# are enough for the operator table and keep the trace small and the end of a short fit light.
DEFAULT_PROFILE_WINDOW = (10, 2)
SYNC_DEBUG_WINDOW = (5, 3)  # torch.cuda.set_sync_debug_mode("warn") at level EXPERT on CUDA: (start, length)


@dataclass(frozen=True)
class PerformanceSettings:
    """What the performance rules and the monitor read, resolved from ``DebugConfig``; the windows are
    ``(first step, length)`` or None (a length of 0 turns the profiler off).

    Example::

        >>> settings = PerformanceSettings.from_config(DebugConfig(level="advanced"))
        >>> settings.frequency, settings.slow_step_factor, settings.profile_window, settings.sync_window
        (10, 3.0, (10, 2), None)
        >>> PerformanceSettings.from_config(DebugConfig(level="advanced", profile_steps=(0, 0))).profile_window is None
        True
    """

    frequency: int = config_value("performance_profiling_frequency")
    log_performance: bool = config_value("log_performance")
    slow_step_factor: float = config_value("slow_step_factor")
    dataloader_bottleneck_share: float = config_value("dataloader_bottleneck_share")
    profile_window: tuple[int, int] | None = None
    sync_window: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, config: DebugConfig) -> PerformanceSettings:
        window = config.profile_steps
        if window is None and config.level >= DebugLevel.ADVANCED:
            window = DEFAULT_PROFILE_WINDOW
        return read_view(cls, config, profile_window=window if window is not None and window[1] > 0 else None,
                         sync_window=SYNC_DEBUG_WINDOW if config.level >= DebugLevel.EXPERT else None)
