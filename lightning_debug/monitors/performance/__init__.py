"""The performance area: step-phase timing, slow steps, data-loader stalls, stragglers, torch.profiler.

Example::

    >>> from lightning_debug.monitors.performance import PerformanceMonitor, PerformanceSettings
    >>> from lightning_debug import DebugConfig
    >>> PerformanceMonitor(DebugConfig(slow_step_factor=4.0), "loop").settings.slow_step_factor
    4.0
"""

from lightning_debug.core.rules import import_rules
from lightning_debug.monitors.performance.monitor import PerformanceMonitor
from lightning_debug.monitors.performance.settings import PerformanceSettings

RULE_MODULES = import_rules(__name__, __path__)  # every module, imported so that each registers its rules

__all__ = ["PerformanceMonitor", "PerformanceSettings"]
