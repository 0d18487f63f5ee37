"""The shared gradient pass, now the package :mod:`lightning_debug.core.numerics` (one concern per
module); this module re-exports its names so that existing imports keep working.
"""

from __future__ import annotations

from lightning_debug.core.numerics.host import HostNumerics
from lightning_debug.core.numerics.index import REQUIRES_GRAD_RECHECK, ParameterIndex
from lightning_debug.core.numerics.observed import Observed
from lightning_debug.core.numerics.owned import Owned
from lightning_debug.core.numerics.queue import MAX_PENDING_READBACKS, NumericsQueue
from lightning_debug.core.numerics.registrations import registration_count, watch_registrations
from lightning_debug.core.numerics.rows import (
    DEVICE_FIELDS,
    HOST_FIELDS,
    RANK_FIELDS,
    AllGather,
    AllReduce,
    constant,
    rank_flags,
    world_position,
)
from lightning_debug.core.numerics.step import StepNumerics

__all__ = [
    "DEVICE_FIELDS", "HOST_FIELDS", "MAX_PENDING_READBACKS", "RANK_FIELDS", "REQUIRES_GRAD_RECHECK", "AllGather",
    "AllReduce", "HostNumerics", "NumericsQueue", "Observed", "Owned", "ParameterIndex", "StepNumerics",
    "constant", "rank_flags", "registration_count", "watch_registrations", "world_position",
]
