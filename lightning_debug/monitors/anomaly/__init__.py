"""The anomaly area: non-finite loss, gradients, parameters and inputs, and a loss that spikes or climbs."""

from lightning_debug.monitors.anomaly.monitor import AnomalyMonitor
from lightning_debug.monitors.anomaly.settings import AnomalySettings

__all__ = ["AnomalyMonitor", "AnomalySettings"]
