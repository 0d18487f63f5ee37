"""lightning-debug: NaN/Inf detection, gradient health, memory and performance profiling for
PyTorch Lightning and Hugging Face Accelerate, cheap enough to leave on.

Example::

    import lightning.pytorch as pl
    from lightning_debug import DebugConfig, debug_callbacks

    trainer = pl.Trainer(callbacks=debug_callbacks(DebugConfig(anomaly_detection_mode="skip")))
"""

from lightning_debug._version import __version__
from lightning_debug.callbacks.anomaly import AnomalyDetectionCallback
from lightning_debug.callbacks.gradients import GradientHealthCallback
from lightning_debug.callbacks.memory import MemoryProfilerCallback
from lightning_debug.callbacks.performance import PerformanceProfilerCallback
from lightning_debug.checks.tensors import TensorStats, inspect_tensor
from lightning_debug.config import DebugConfig, DebugLevel, DebugMode
from lightning_debug.errors import AnomalyError
from lightning_debug.presets import debug_callbacks

__all__ = [
    "AnomalyDetectionCallback",
    "AnomalyError",
    "DebugConfig",
    "DebugLevel",
    "DebugMode",
    "GradientHealthCallback",
    "MemoryProfilerCallback",
    "PerformanceProfilerCallback",
    "TensorStats",
    "__version__",
    "debug_callbacks",
    "inspect_tensor",
]
