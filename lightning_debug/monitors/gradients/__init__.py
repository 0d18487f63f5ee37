"""Gradient health: exploding, vanishing, missing gradients and parameters the optimizer never moves.

Every module of this package is imported here (:func:`~lightning_debug.core.rules.import_rules`), so a rule module
registers its rules without an import edit anywhere.
"""

from lightning_debug.core.rules import import_rules
from lightning_debug.monitors.gradients.monitor import GradientMonitor
from lightning_debug.monitors.gradients.settings import GradientSettings

RULE_MODULES = import_rules(__name__, __path__)

__all__ = ["GradientMonitor", "GradientSettings"]
