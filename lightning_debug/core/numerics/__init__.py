"""Loss, gradient and parameter health of one optimizer step, computed once for every check.

The anomaly and gradient checks both need gradient norms: :class:`StepNumerics` does one fused pass, packs it
(per-rank flags included) into one device vector, reduces it with one collective and reads it back at most once,
now or a step later; docs/architecture.md describes it.
    >>> import torch
    >>> from torch import nn
    >>> from lightning_debug.core.numerics import NumericsQueue
    >>> model = nn.Linear(3, 1, bias=False)
    >>> model(torch.ones(1, 3)).sum().backward()
    >>> round(NumericsQueue().get(0, model.named_parameters, None).read().global_grad_norm, 4)
    1.7321
"""

from __future__ import annotations

from lightning_debug.core.numerics.index import REQUIRES_GRAD_RECHECK, AllGather, AllReduce, ParameterIndex
from lightning_debug.core.numerics.queue import NumericsQueue
from lightning_debug.core.numerics.step import HostNumerics, StepNumerics

__all__ = ["REQUIRES_GRAD_RECHECK", "AllGather", "AllReduce", "HostNumerics", "NumericsQueue", "ParameterIndex",
           "StepNumerics"]
