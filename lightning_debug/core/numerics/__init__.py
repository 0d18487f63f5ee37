"""Loss, gradient and parameter health of one optimizer step, computed once for every check.

The anomaly and gradient checks both need gradient norms. :class:`StepNumerics` does one fused pass, packs
everything (per-rank flags included) into one device vector, reduces it across processes with one collective,
and reads it back to the host at most once, now or a step later. What does not change from step to step is
worked out once (:class:`ParameterIndex`, rebuilt only when a registration may have changed the model), so a
healthy check step does no Python work per parameter beyond collecting the gradients. Sharded parameters are
measured on their local shards; each rank contributes the squares of the blocks it owns, so the one all-reduce
that carries every rank's flags also yields exact full-parameter norms.

:mod:`.index`: the parameters, built once, and a rank's row; :mod:`.step`: the forward's losses and batches,
the device pass and its host values; :mod:`.queue`: the pass shared by every check, and the pending read-backs.

Example::

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
