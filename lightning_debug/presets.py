"""From a :class:`DebugConfig` to the callbacks its ``mode`` enables."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lightning_debug.callbacks.anomaly import AnomalyDetectionCallback
from lightning_debug.callbacks.gradients import GradientHealthCallback
from lightning_debug.callbacks.memory import MemoryProfilerCallback
from lightning_debug.callbacks.performance import PerformanceProfilerCallback
from lightning_debug.config import DebugConfig, DebugMode

CALLBACKS_BY_MODE: dict[DebugMode, tuple[type[Callback], ...]] = {
    DebugMode.NONE: (),
    DebugMode.ANOMALY_DETECTION: (AnomalyDetectionCallback,),
    DebugMode.GRADIENT_CHECKING: (GradientHealthCallback,),
    DebugMode.MEMORY_PROFILING: (MemoryProfilerCallback,),
    DebugMode.PERFORMANCE_PROFILING: (PerformanceProfilerCallback,),
    DebugMode.FULL_DEBUG: (AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback,
                           PerformanceProfilerCallback),
}


def debug_callbacks(config: DebugConfig | None = None) -> list[Callback]:
    """The callbacks that ``config.mode`` enables, all sharing ``config``.

    Example::

        >>> from lightning_debug import DebugConfig, debug_callbacks
        >>> [type(c).__name__ for c in debug_callbacks(DebugConfig(mode="anomaly_detection"))]
        ['AnomalyDetectionCallback']
    """
    config = config or DebugConfig()
    return [callback_type(config) for callback_type in CALLBACKS_BY_MODE[config.mode]]  # type: ignore[call-arg]
