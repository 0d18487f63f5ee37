"""Gradient health: exploding, vanishing, missing gradients and parameters the optimizer never moves."""

from lightning_debug.monitors.gradients.monitor import GradientMonitor
from lightning_debug.monitors.gradients.settings import GradientSettings

__all__ = ["GradientMonitor", "GradientSettings"]
