"""From a :class:`DebugConfig` to the Lightning callbacks its ``mode`` enables."""

from __future__ import annotations

from typing import Any

from lightning_debug.callbacks.anomaly import AnomalyDetectionCallback
from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.callbacks.gradients import GradientHealthCallback
from lightning_debug.callbacks.memory import MemoryProfilerCallback
from lightning_debug.callbacks.performance import PerformanceProfilerCallback
from lightning_debug.config import Area, DebugConfig, DebugMode, as_config
from lightning_debug.monitors import AREA_SPECS

_CALLBACKS = {callback.__name__: callback for callback in (
    AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback, PerformanceProfilerCallback)}

CALLBACK_BY_AREA: dict[Area, type[DebugCallback]] = {
    area: _CALLBACKS[spec.callback] for area, spec in AREA_SPECS.items() if spec.callback is not None}
"""The Lightning callback of each area that has one, from the table of areas (``AreaSpec.callback``)."""


def debug_callbacks(config: DebugConfig | dict[str, Any] | DebugMode | str | None = None) -> list[DebugCallback]:
    """The callbacks that ``config.mode`` enables, all sharing ``config`` (a :class:`DebugConfig`, a mapping of its
    fields, a mode or its name, or None for the defaults).

    Example::

        >>> [type(c).__name__ for c in debug_callbacks(DebugConfig(mode="anomaly_detection"))]
        ['AnomalyDetectionCallback']
        >>> [type(c).__name__ for c in debug_callbacks("gradient_checking")]
        ['GradientHealthCallback']
    """
    config = as_config(config)
    return [CALLBACK_BY_AREA[area](config) for area in config.areas]
