"""The areas of checks: framework-free monitors the run drives through the same events in every framework;
which ones a config gets is the table of areas (:data:`~lightning_debug.monitors.areas.AREA_SPECS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.monitor import Monitor
from lightning_debug.monitors.areas import AREA_SPECS, AreaSpec

__all__ = ["AREA_SPECS", "AreaSpec", "companion_monitors", "monitors_for", "run_monitors"]


def monitors_for(config: DebugConfig, source: str, batch_size_fn: Callable[[Any], int] | None = None,
                 tokens_fn: Callable[[Any], int] | None = None) -> list[Monitor]:
    """One monitor per area that ``config.mode`` enables, writing events as ``source``::

        >>> [type(m).__name__ for m in monitors_for(DebugConfig(mode="anomaly_detection"), "loop")]
        ['AnomalyMonitor', 'LoopMonitor', 'ErrorMonitor']
    """
    options: dict[Area, dict[str, Any]] = {Area.PERFORMANCE: {"batch_size_fn": batch_size_fn, "tokens_fn": tokens_fn}}
    monitors = [monitor for area in config.areas
                for monitor in (AREA_SPECS[area].build(config, source, **options.get(area, {})),
                                *companion_monitors(area, config, source))]
    return monitors + (run_monitors(config, source) if monitors else [])


def companion_monitors(area: Area, config: DebugConfig, source: str) -> list[Monitor]:
    """The monitors that come with ``area``'s: the activation verdicts with the gradients::

        >>> [type(m).__name__ for m in companion_monitors(Area.GRADIENTS, DebugConfig(), "loop")]
        ['ActivationMonitor']
    """
    companions = (AREA_SPECS[companion] for companion in AREA_SPECS[area].companions)
    return [spec.build(config, source) for spec in companions]


def run_monitors(config: DebugConfig, source: str) -> list[Monitor]:
    """The monitors a run has once, whatever its areas: the loop's silent killers and the explained exception."""
    return [spec.build(config, source) for spec in AREA_SPECS.values() if spec.run_wide]
