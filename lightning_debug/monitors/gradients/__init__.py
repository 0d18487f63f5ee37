"""Gradient health: exploding, vanishing, missing gradients and parameters the optimizer never moves.

:mod:`.monitor` is the plumbing (events, read-backs, scalars, state); each verdict is a rule of its
own, a pure function over what a check step observed: :mod:`.exploding`, :mod:`.vanishing`,
:mod:`.missing`, :mod:`.trainability`, :mod:`.update_ratio`, reading :class:`.settings.GradientSettings`.
"""

from lightning_debug.monitors.gradients.monitor import GradientMonitor
from lightning_debug.monitors.gradients.settings import GradientSettings

__all__ = ["GradientMonitor", "GradientSettings"]
