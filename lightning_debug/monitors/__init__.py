"""The areas of checks: framework-free monitors that the run (:mod:`lightning_debug.run`) drives
through the same events in every framework.

The four callback areas (anomaly, gradients, memory, performance) follow ``DebugConfig.mode``;
activation statistics come with the gradients area when ``log_activations`` is on
(:func:`companion_monitors`); the training loop's silent killers and the explained exception come
once per run whatever areas are on (:func:`run_monitors`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.monitor import Monitor


def monitors_for(config: DebugConfig, source: str, batch_size_fn: Callable[[Any], int] | None = None,
                 tokens_fn: Callable[[Any], int] | None = None) -> list[Monitor]:
    """One monitor per area that ``config.mode`` enables, writing events as ``source``.

    Example::

        >>> [type(m).__name__ for m in monitors_for(DebugConfig(mode="anomaly_detection"), "loop")]
        ['AnomalyMonitor', 'LoopMonitor', 'ErrorMonitor']
    """
    from lightning_debug.monitors.anomaly import AnomalyMonitor
    from lightning_debug.monitors.gradients import GradientMonitor
    from lightning_debug.monitors.memory import MemoryMonitor
    from lightning_debug.monitors.performance import PerformanceMonitor

    makers: dict[Area, Callable[[], Monitor]] = {
        Area.ANOMALY: lambda: AnomalyMonitor(config, source),
        Area.GRADIENTS: lambda: GradientMonitor(config, source),
        Area.MEMORY: lambda: MemoryMonitor(config, source),
        Area.PERFORMANCE: lambda: PerformanceMonitor(config, source, batch_size_fn=batch_size_fn, tokens_fn=tokens_fn),
    }
    monitors = [monitor for area in config.areas
                for monitor in (makers[area](), *companion_monitors(area, config, source))]
    return monitors + (run_monitors(config, source) if monitors else [])


def companion_monitors(area: Area, config: DebugConfig, source: str) -> list[Monitor]:
    """The monitors that come with ``area``'s: activation statistics with the gradients, when ``log_activations``.

    Example::

        >>> [type(m).__name__ for m in companion_monitors(Area.GRADIENTS, DebugConfig(log_activations=True), "loop")]
        ['ActivationMonitor']
    """
    if area is Area.GRADIENTS and config.log_activations:
        from lightning_debug.monitors.activations import ActivationMonitor

        return [ActivationMonitor(config, source)]
    return []


def run_monitors(config: DebugConfig, source: str) -> list[Monitor]:
    """The monitors a run has once, whatever its areas: the loop's silent killers and the explained exception."""
    from lightning_debug.monitors.errors import ErrorMonitor
    from lightning_debug.monitors.loop import LoopMonitor

    return [LoopMonitor(config, source), ErrorMonitor(config, source)]
