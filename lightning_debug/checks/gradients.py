"""Gradient and weight measurements over many tensors: fused device work, no host sync.

Every function that touches tensors returns device tensors; the monitor reads them back once,
usually a step later. The host-side helpers turn those values into advice a user can act on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_debug.checks.numerics import fused_norms

HISTOGRAM_CHUNK = 1 << 24
SUMMARY_FIELDS = ("min", "max", "num", "sum", "sum_squares")


def clone_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` (the weights before an optimizer step), in fused kernels.

    Example::

        >>> weights = [torch.ones(2), torch.zeros(3)]
        >>> copies = clone_tensors(weights); _ = weights[0].add_(1.0); copies[0].tolist()
        [1.0, 1.0]
    """
    if not tensors:
        return []
    return list(torch._foreach_mul([t.detach() for t in tensors], 1.0))


def update_norms(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||after_i - before_i||`` for each pair, as one float32 device vector (no sync).

    Example::

        >>> update_norms([torch.zeros(2)], [torch.tensor([3.0, 4.0])]).tolist()
        [5.0]
    """
    if not before:
        return torch.zeros(0, dtype=torch.float32)
    return fused_norms(torch._foreach_sub([t.detach() for t in after], list(before)))


def _summary_row(tensor: torch.Tensor, bins: int) -> torch.Tensor:
    values = (tensor.detach().coalesce().values() if tensor.is_sparse else tensor.detach()).reshape(-1)
    if values.is_complex():
        values = values.abs()
    values = values.float()
    if not values.numel():
        return torch.zeros(len(SUMMARY_FIELDS) + bins, dtype=torch.float32, device=values.device)
    finite = torch.isfinite(values)
    count = finite.sum().float()
    low = torch.where(finite, values, math.inf).amin()
    high = torch.where(finite, values, -math.inf).amax()
    low = torch.where(count > 0, low, torch.zeros_like(low))
    high = torch.where(count > 0, high, torch.zeros_like(high))
    width = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    counts = torch.zeros(bins, dtype=torch.float32, device=values.device)
    total = values.new_zeros(())
    squares = values.new_zeros(())
    for chunk, chunk_finite in zip(values.split(HISTOGRAM_CHUNK), finite.split(HISTOGRAM_CHUNK)):
        clean = torch.where(chunk_finite, chunk, 0.0)
        total = total + clean.sum()
        squares = squares + clean.square().sum()
        index = ((clean - low) / width * bins).floor_().clamp_(0, bins - 1).to(torch.int32)
        counts.index_add_(0, index, chunk_finite.float())
    return torch.cat([torch.stack([low, high, count, total, squares]), counts])


def histogram_summaries(tensors: Sequence[torch.Tensor], bins: int = 30) -> torch.Tensor:
    """Per tensor: min, max, count, sum, sum of squares and ``bins`` equal-width bucket counts.

    Only finite values count. Computed on the tensors' device with no host sync (``torch.histc``
    on CUDA reads min/max back to the host, so the buckets are filled with ``index_add_``); large
    tensors are processed in chunks to bound the temporary memory. Returns a float32 tensor of
    shape ``[len(tensors), 5 + bins]``; :func:`histogram_from_row` turns a row into the arguments of
    ``SummaryWriter.add_histogram_raw``.

    Example::

        >>> row = histogram_summaries([torch.tensor([0.0, 1.0, 1.0, float("nan")])], bins=2)[0]
        >>> row.tolist()
        [0.0, 1.0, 3.0, 2.0, 2.0, 1.0, 2.0]
    """
    if not tensors:
        return torch.zeros(0, len(SUMMARY_FIELDS) + bins, dtype=torch.float32)
    rows = [_summary_row(tensor, bins) for tensor in tensors]
    device = rows[0].device
    return torch.stack([row.to(device, non_blocking=True) for row in rows])


def histogram_from_row(row: Sequence[float], bins: int) -> dict[str, Any]:
    """Host values of one :func:`histogram_summaries` row as ``add_histogram_raw`` keyword arguments.

    Like TensorBoard's own ``make_histogram``, the left edge is included as an empty first bucket.

    Example::

        >>> histogram_from_row([0.0, 1.0, 3.0, 2.0, 2.0, 1.0, 2.0], bins=2)["bucket_limits"]
        [0.0, 0.5, 1.0]
    """
    low, high, num, total, squares = (float(v) for v in row[:len(SUMMARY_FIELDS)])
    counts = [float(v) for v in row[len(SUMMARY_FIELDS):len(SUMMARY_FIELDS) + bins]]
    if high <= low:
        high = low + max(abs(low) * 1e-6, 1e-12)
    width = (high - low) / bins
    limits = [low + i * width for i in range(bins)] + [high]
    return {"min": low, "max": high, "num": num, "sum": total, "sum_squares": squares,
            "bucket_limits": limits, "bucket_counts": [0.0] + counts}


def round_significant(value: float, digits: int = 2) -> float:
    """``value`` rounded to ``digits`` significant digits, for advice people type into a config.

    Example::

        >>> round_significant(3.14159), round_significant(1234.5)
        (3.1, 1200.0)
    """
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def suggest_clip_value(healthy_norms: Sequence[float], threshold: float, quantile: float = 0.9,
                       minimum_history: int = 3) -> tuple[float, str]:
    """A ``gradient_clip_val`` taken from the run's own recent healthy global norms.

    Clipping at a high quantile of the norms a run has when it is healthy leaves normal steps
    alone and caps the spikes. Without enough history it falls back to the explosion threshold.
    Returns the value and a sentence saying where it comes from.

    Example::

        >>> suggest_clip_value([1.0, 2.0, 3.0, 4.0], threshold=10.0)
        (4.0, '90th percentile of the last 4 healthy global gradient norms')
        >>> suggest_clip_value([], threshold=10.0)[0]
        10.0
    """
    finite = sorted(v for v in healthy_norms if math.isfinite(v))
    if len(finite) < minimum_history:
        return threshold, "the gradient_explosion_threshold; too few healthy check steps yet to learn from"
    value = finite[min(len(finite) - 1, int(quantile * len(finite)))]
    return (round_significant(value),
            f"{round(quantile * 100)}th percentile of the last {len(finite)} healthy global gradient norms")
