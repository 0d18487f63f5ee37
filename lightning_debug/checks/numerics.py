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
    return torch.stack([norm.to(device, non_blocking=True) for norm in results])  # type: ignore[union-attr]


def global_norm(norms: torch.Tensor) -> torch.Tensor:
    """The 2-norm of the concatenation of tensors, from their individual norms."""
    return torch.linalg.vector_norm(norms) if norms.numel() else norms.new_zeros(())


def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: every element of ``tensor`` is finite (no sync)."""
    return torch.isfinite(tensor.detach()).all()


def nonfinite_positions(values: Sequence[float]) -> list[int]:
    """Indices of the host values that are NaN or infinite."""
    return [i for i, value in enumerate(values) if not math.isfinite(value)]


def elements_nonfinite(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor: does it hold a NaN/Inf element? One sync; for the rare confirmation path only.

    A norm can overflow to ``inf`` for large finite values, so a non-finite norm is confirmed here
    before a parameter is called non-finite.
    """
    if not tensors:
        return []
    flags = [~torch.isfinite(t.detach()).all() if t.numel() and (t.is_floating_point() or t.is_complex())
             else torch.zeros((), dtype=torch.bool, device=t.device) for t in tensors]
    device = flags[0].device
    return [bool(v) for v in torch.stack([f.to(device) for f in flags]).tolist()]


def max_abs(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Largest finite magnitude of each tensor (rare path: one sync)."""
    if not tensors:
        return []
    out = []
    for t in tensors:
        data = t.detach().float()
        finite = data[torch.isfinite(data)]
        out.append(finite.abs().max() if finite.numel() else data.new_zeros(()))
    device = out[0].device
    return torch.stack([v.to(device) for v in out]).tolist()
