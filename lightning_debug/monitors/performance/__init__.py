"""The performance area: step-phase timing, slow steps, data-loader stalls, stragglers, torch.profiler.

Example::

    >>> from lightning_debug.monitors.performance import PerformanceMonitor, PerformanceSettings
    >>> from lightning_debug import DebugConfig
    >>> PerformanceMonitor(DebugConfig(slow_step_factor=4.0), "loop").settings.slow_step_factor
    4.0
"""

from lightning_debug.monitors.performance.monitor import PerformanceMonitor
from lightning_debug.monitors.performance.settings import PerformanceSettings

__all__ = ["PerformanceMonitor", "PerformanceSettings"]
