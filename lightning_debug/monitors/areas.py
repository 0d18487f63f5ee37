"""The one table of areas; ``monitors_for``, the callbacks and ``presets.CALLBACK_BY_AREA`` read it (callbacks by
name: monitors never import adapters)::

    >>> from lightning_debug import DebugConfig
    >>> spec = AREA_SPECS[Area.ANOMALY]
    >>> spec.monitor.__name__, spec.frequency(DebugConfig(anomaly_check_frequency=5)), spec.callback
    ('AnomalyMonitor', 5, 'AnomalyDetectionCallback')
    >>> [area.value for area, spec in AREA_SPECS.items() if spec.run_wide]
    ['loop', 'errors']
    >>> AREA_SPECS[Area.ANOMALY].build(DebugConfig(anomaly_check_frequency=5), "loop").frequency
    5
    >>> coverage({Area.GRADIENTS, Area.ACTIVATIONS, Area.LOOP})["watched"]
    ['gradients']
    >>> [row["callback"] for row in coverage({Area.GRADIENTS, Area.ACTIVATIONS, Area.LOOP})["unwatched"]]
    ['AnomalyDetectionCallback', 'MemoryProfilerCallback', 'PerformanceProfilerCallback']
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.monitor import Monitor
from lightning_debug.monitors.activations import ActivationMonitor
from lightning_debug.monitors.anomaly import AnomalyMonitor
from lightning_debug.monitors.errors import ErrorMonitor
from lightning_debug.monitors.gradients import GradientMonitor
from lightning_debug.monitors.loop import LoopMonitor
from lightning_debug.monitors.memory import MemoryMonitor
from lightning_debug.monitors.performance import PerformanceMonitor


@dataclass(frozen=True)
class AreaSpec:
    """One area's row: ``settings`` tell two of its callbacks apart (``own_fields``, the state key), ``callback``
    is its Lightning callback's name and ``watches`` what a run without it cannot see, ``run_wide`` areas come once
    per run whatever areas are on."""

    area: Area
    monitor: type[Monitor]
    frequency: Callable[[DebugConfig], int]
    settings: tuple[str, ...] = ()
    companions: tuple[Area, ...] = ()
    callback: str | None = None
    watches: str = ""
    run_wide: bool = False

    def build(self, config: DebugConfig, source: str, **options: Any) -> Monitor:
        """This area's monitor, writing events as ``source``."""
        return self.monitor(config, source, **options)


AREA_SPECS: dict[Area, AreaSpec] = {spec.area: spec for spec in (  # in Area order, the order the run calls them in
    AreaSpec(Area.ANOMALY, AnomalyMonitor, lambda config: config.anomaly_check_frequency,
             settings=("anomaly_detection_mode", "anomaly_check_frequency"), callback="AnomalyDetectionCallback",
             watches="the loss and activations"),
    AreaSpec(Area.GRADIENTS, GradientMonitor, lambda config: config.gradient_checking_frequency,
             settings=("gradient_checking_frequency",), companions=(Area.ACTIVATIONS,),
             callback="GradientHealthCallback", watches="gradients"),
    AreaSpec(Area.ACTIVATIONS, ActivationMonitor, lambda config: config.gradient_checking_frequency),
    AreaSpec(Area.MEMORY, MemoryMonitor, lambda config: config.memory_profiling_frequency,
             settings=("memory_profiling_frequency",), callback="MemoryProfilerCallback", watches="memory"),
    AreaSpec(Area.PERFORMANCE, PerformanceMonitor, lambda config: config.performance_profiling_frequency,
             settings=("performance_profiling_frequency",), callback="PerformanceProfilerCallback",
             watches="step time"),
    AreaSpec(Area.LOOP, LoopMonitor, lambda config: config.gradient_checking_frequency, run_wide=True),
    AreaSpec(Area.ERRORS, ErrorMonitor, lambda config: config.anomaly_check_frequency, run_wide=True),
)}

for _spec in AREA_SPECS.values():
    # A monitor built directly (``AnomalyMonitor(config, source)``, as tests and hand-written loops do) reads
    # its frequency through the same row as one built from the table.
    _spec.monitor.frequency_of = staticmethod(_spec.frequency)  # type: ignore[assignment]


def coverage(areas: Collection[Area]) -> dict[str, list[Any]]:
    """Which callback areas a run with ``areas`` watches, and what the others would have watched with their
    callbacks: a report that found nothing says so beside "No problems found", since a failure in an area no
    callback watched could not show (a loss that oscillated under ``GradientHealthCallback`` alone)."""
    rows = [spec for spec in AREA_SPECS.values() if spec.callback is not None]
    return {"watched": [spec.area.value for spec in rows if spec.area in areas],
            "unwatched": [{"area": spec.area.value, "watches": spec.watches, "callback": spec.callback}
                          for spec in rows if spec.area not in areas]}
