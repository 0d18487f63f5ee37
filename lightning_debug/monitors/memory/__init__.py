"""Memory over the run: readings, ``memory_high``, leaks found and explained, the OOM post-mortem::

    >>> from lightning_debug import DebugConfig
    >>> from lightning_debug.core.monitor import RunContext
    >>> from lightning_debug.run import Run
    >>> from lightning_debug.monitors.memory import MemoryMonitor
    >>> monitor = MemoryMonitor(DebugConfig(memory_profiling_frequency=5), "my_loop")
    >>> run = Run(DebugConfig(save_debug_info=False), RunContext(), [monitor])
    >>> run.start(0)
    >>> for step in range(20):
    ...     _ = run.before_optimizer_step(step, None)
    >>> run.finalize(19)
    >>> monitor.report_section()["stats"]["memory/cpu_rss_mb"]["count"]
    4
"""

from __future__ import annotations

from lightning_debug.core.rules import import_rules
from lightning_debug.monitors.memory.monitor import MemoryMonitor
from lightning_debug.monitors.memory.settings import MemorySettings

RULE_MODULES = import_rules(__name__, __path__)  # each module registers its rules

__all__ = ["MemoryMonitor", "MemorySettings"]
