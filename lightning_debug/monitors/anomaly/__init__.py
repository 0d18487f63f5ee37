"""The anomaly area: non-finite loss, gradients, parameters and inputs, and a loss that spikes or climbs.

:mod:`.monitor` is the plumbing (events, read-backs, state, recording); the rules are small pure
modules it calls: :mod:`.policy` (what a step shows and what the run does), :mod:`.forensics`
(which update broke the weights), :mod:`.replay` (naming the cause by replaying the step),
:mod:`.prose` (the wording of every finding), :mod:`.divergence` (loss spike and divergence
findings), with typed settings in :mod:`.settings`.
"""

from lightning_debug.monitors.anomaly.monitor import AnomalyMonitor
from lightning_debug.monitors.anomaly.settings import AnomalySettings

__all__ = ["AnomalyMonitor", "AnomalySettings"]
