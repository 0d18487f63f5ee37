"""The anomaly area: non-finite loss, gradients, parameters and inputs, and a loss that spikes or climbs."""

from lightning_debug.core.rules import import_rules
from lightning_debug.monitors.anomaly.monitor import AnomalyMonitor
from lightning_debug.monitors.anomaly.settings import AnomalySettings

RULE_MODULES = import_rules(__name__, __path__)  # each module registers its rules

__all__ = ["AnomalyMonitor", "AnomalySettings"]
