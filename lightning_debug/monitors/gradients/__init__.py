"""Gradient health: exploding, vanishing, missing gradients and parameters the optimizer never moves. Every module
here is imported (:func:`~lightning_debug.core.rules.import_rules`): a rule module registers without an import edit.
"""

from lightning_debug.core.rules import import_rules
from lightning_debug.monitors.gradients.monitor import GradientMonitor
from lightning_debug.monitors.gradients.settings import GradientSettings

RULE_MODULES = import_rules(__name__, __path__)

__all__ = ["GradientMonitor", "GradientSettings"]
