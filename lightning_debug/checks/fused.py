"""Torch's fused multi-tensor operations, behind feature probes with public fallbacks.

``torch._foreach_*`` and ``flatten_dense_tensors`` are private: a torch release may add a keyword or drop a name.
Each is probed once, at import; where one is missing, public per-tensor operations give the same numbers (slower
on a GPU, never a host sync, never a failed check).

>>> import torch
>>> [round(n.item(), 3) for n in norms([torch.ones(4), torch.tensor([3.0, 4.0])], 2, torch.float32)]
[2.0, 5.0]
>>> flatten([torch.ones(2, 2), torch.zeros(1)]).tolist()
[1.0, 1.0, 1.0, 1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FOREACH", "FOREACH_NORM_DTYPE", "FLATTEN_DENSE", "copy_", "flatten", "norms", "scaled", "subtracted"]

FOREACH = {name: callable(getattr(torch, name, None))
           for name in ("_foreach_norm", "_foreach_mul", "_foreach_sub", "_foreach_copy_")}
"""Which fused ``torch._foreach_*`` functions the installed torch has."""


def _norm_takes_dtype() -> bool:
    if not FOREACH["_foreach_norm"]:
        return False
    try:
        torch._foreach_norm([torch.ones(1, dtype=torch.float16)], 2, dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch < 2.4: "unexpected keyword argument 'dtype'"
        return False
    return True


FOREACH_NORM_DTYPE = _norm_takes_dtype()
"""Whether ``torch._foreach_norm`` takes ``dtype=`` (accumulate half types in float32): torch 2.4+."""
FLATTEN_DENSE = callable(getattr(getattr(getattr(torch, "_C", None), "_nn", None), "flatten_dense_tensors", None))
"""Whether ``torch._C._nn.flatten_dense_tensors`` (one copy into one buffer) exists."""


def norms(tensors: Sequence[torch.Tensor], order: float = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The ``order``-norm of each tensor as a 0-d tensor; ``dtype`` accumulates (and returns) in that type."""
    accumulate = {} if dtype is None else {"dtype": dtype}
    fused = FOREACH["_foreach_norm"] if dtype is None else FOREACH_NORM_DTYPE
    if fused:
        return list(torch._foreach_norm(list(tensors), order, **accumulate))
    return [torch.linalg.vector_norm(t, order, **accumulate) for t in tensors]


def scaled(tensors: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """New tensors ``t * factor`` (``factor=1.0``: copies)."""
    if FOREACH["_foreach_mul"]:
        return list(torch._foreach_mul(list(tensors), factor))
    return [t * factor for t in tensors]


def subtracted(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors ``a - b`` pairwise."""
    if FOREACH["_foreach_sub"]:
        return list(torch._foreach_sub(list(tensors), list(others)))
    return [a - b for a, b in zip(tensors, others)]


def copy_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its destination, in place."""
    if FOREACH["_foreach_copy_"]:
        torch._foreach_copy_(list(destinations), list(sources))
        return
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The values of dense ``tensors``, one after the other, as one 1-d tensor."""
    if FLATTEN_DENSE:
        return torch._C._nn.flatten_dense_tensors(list(tensors))
    return torch.cat([t.reshape(-1) for t in tensors])
