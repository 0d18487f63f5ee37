"""Fused numeric health of many tensors: one kernel launch per device, no host sync.

Everything here returns device tensors; the caller decides when (and whether) to read them back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def fused_norms(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The 2-norm of each tensor as one float32 vector, computed with ``torch._foreach_norm``.

    Dense floating tensors of one device and dtype go through one fused kernel; sparse, complex and
    integer tensors (rare) are handled one by one. A non-finite element makes its norm non-finite,
    so the norms double as a finiteness test.

    Example::

        >>> fused_norms([torch.ones(4), torch.tensor([3.0, 4.0])]).tolist()
        [2.0, 5.0]
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    results: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.is_sparse:
            results[index] = torch.linalg.vector_norm(tensor.coalesce().values().detach().abs().float())
        elif tensor.is_complex() or not tensor.is_floating_point():
            results[index] = torch.linalg.vector_norm(tensor.detach().abs().float())
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for (_, dtype), indices in groups.items():
        group = [tensors[i].detach() for i in indices]
        # float32 accumulation for half types; float64 cannot be narrowed inside the kernel.
        norms = (torch._foreach_norm(group, 2) if dtype == torch.float64
                 else torch._foreach_norm(group, 2, dtype=torch.float32))
        for index, norm in zip(indices, norms):
            results[index] = norm.float()
    if len(groups) == 1 and next(iter(groups))[0] == device and len(groups[next(iter(groups))]) == len(tensors):
        return torch.stack(results)  # type: ignore[arg-type]
    return torch.stack([norm.to(device, non_blocking=True) for norm in results])  # type: ignore[union-attr]


def nonfinite_named(names: Sequence[str], norms: torch.Tensor) -> list[tuple[str, float]]:
    """The ``(name, norm)`` pairs whose norm is NaN or infinite; one read-back (rare paths only).

    Example::

        >>> nonfinite_named(["a", "b"], torch.tensor([1.0, float("inf")]))
        [('b', inf)]
    """
    return [(name, value) for name, value in zip(names, norms.tolist()) if not math.isfinite(value)]
