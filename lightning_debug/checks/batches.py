"""What is in a batch (a tensor, a tuple, a list, a mapping such as a ``BatchEncoding``, or nests of those): its
floating tensors by position, and which samples hold NaN/Inf, looked up only once a batch is known to be bad.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

MAX_SAMPLES_LISTED = 50


def named_tensors(batch: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a nested batch with its position, e.g. ``batch[0]`` or ``batch['pixel_values']``.

    >>> [name for name, _ in named_tensors({"x": torch.ones(2), "y": [torch.ones(1), 3]})]
    ["batch['x']", "batch['y'][0]"]
    """
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [item for key, value in batch.items() for item in named_tensors(value, f"{path}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [item for index, value in enumerate(batch) for item in named_tensors(value, f"{path}[{index}]")]
    return []


def floating_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The dense, non-empty floating-point and complex tensors of a batch (labels and token ids cannot be NaN; a
    complex signal can, in either part).

    >>> batch = {"x": torch.ones(2, dtype=torch.complex64), "y": torch.tensor([1, 2])}
    >>> [name for name, _ in floating_tensors(batch)]
    ["batch['x']"]
    """
    return [(name, t) for name, t in named_tensors(batch)
            if (t.is_floating_point() or t.is_complex()) and not t.is_sparse and t.numel() > 0]


def nonfinite_samples(tensor: torch.Tensor, limit: int = MAX_SAMPLES_LISTED) -> tuple[list[int], int]:
    """Indices along the first dimension (the samples) that hold NaN/Inf, and the number of bad values.

    One host read; call it only for a tensor known to hold non-finite values.

    >>> x = torch.zeros(8, 3); x[5, 1] = float("nan"); x[6, 0] = float("inf")
    >>> nonfinite_samples(x)
    ([5, 6], 2)
    """
    bad = ~torch.isfinite(tensor.detach())
    if tensor.dim() == 0:
        return [], int(bad)
    per_sample = bad.reshape(tensor.shape[0], -1).any(dim=1)
    indices = per_sample.nonzero().flatten()[:limit].tolist()
    return [int(i) for i in indices], int(bad.sum())
