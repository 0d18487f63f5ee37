"""lightning-debug: NaN/Inf detection, gradient health, memory and performance profiling for
PyTorch Lightning and Hugging Face Accelerate, cheap enough to leave on.

Example::

    import lightning.pytorch as pl
    from lightning_debug import DebugConfig, debug_callbacks

    trainer = pl.Trainer(callbacks=debug_callbacks(DebugConfig(anomaly_detection_mode="skip")))

The names below are imported on first use, so ``lightning-debug --version`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_debug._version import __version__

_EXPORTS = {
    "AnomalyDetectionCallback": "lightning_debug.callbacks.anomaly",
    "GradientHealthCallback": "lightning_debug.callbacks.gradients",
    "MemoryProfilerCallback": "lightning_debug.callbacks.memory",
    "PerformanceProfilerCallback": "lightning_debug.callbacks.performance",
    "TensorStats": "lightning_debug.checks.tensors",
    "check_labels": "lightning_debug.checks.tensors",
    "is_replaying": "lightning_debug.checks.localize",
    "inspect_tensor": "lightning_debug.checks.tensors",
    "AnomalyMode": "lightning_debug.config",
    "DebugConfig": "lightning_debug.config",
    "DebugLevel": "lightning_debug.config",
    "DebugMode": "lightning_debug.config",
    "AnomalyError": "lightning_debug.errors",
    "debug_callbacks": "lightning_debug.presets",
}

__all__ = [
    "AnomalyDetectionCallback",
    "AnomalyError",
    "AnomalyMode",
    "DebugConfig",
    "DebugLevel",
    "DebugMode",
    "GradientHealthCallback",
    "MemoryProfilerCallback",
    "PerformanceProfilerCallback",
    "TensorStats",
    "__version__",
    "check_labels",
    "debug_callbacks",
    "inspect_tensor",
    "is_replaying",
]

if TYPE_CHECKING:
    from lightning_debug.callbacks.anomaly import AnomalyDetectionCallback
    from lightning_debug.callbacks.gradients import GradientHealthCallback
    from lightning_debug.callbacks.memory import MemoryProfilerCallback
    from lightning_debug.callbacks.performance import PerformanceProfilerCallback
    from lightning_debug.checks.localize import is_replaying
    from lightning_debug.checks.tensors import TensorStats, check_labels, inspect_tensor
    from lightning_debug.config import AnomalyMode, DebugConfig, DebugLevel, DebugMode
    from lightning_debug.errors import AnomalyError
    from lightning_debug.presets import debug_callbacks


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_debug' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except AttributeError as error:
        # ``from lightning_debug import x`` turns an AttributeError raised here into a bare "cannot import
        # name 'x'", hiding the real cause (a name the installed Python or torch lacks): say it.
        raise ImportError(f"lightning_debug.{name} could not be imported from {module}: {error!r}") from error
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
