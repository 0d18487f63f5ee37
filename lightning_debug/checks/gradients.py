"""Histograms of many tensors as device tensors (no host sync; the monitor reads them back once, usually a step
later), and the clip value an ``exploding_grad`` finding advises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_debug.checks import fused
from lightning_debug.checks.memory.census import graph_reach

HISTOGRAM_CHUNK = 1 << 24
HISTOGRAM_BATCH = 1 << 22
HISTOGRAM_SMALL = 1 << 16
SUMMARY_FIELDS = ("min", "max", "num", "sum", "sum_squares")


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


def _summary_rows(tensors: Sequence[torch.Tensor], bins: int) -> torch.Tensor:
    """:func:`_summary_row` of many small dense tensors of one device at once (one buffer, one ``index_add_``)."""
    values = fused.flatten(tensors).float()
    lengths = torch.tensor([t.numel() for t in tensors], device=values.device)
    segment = torch.repeat_interleave(torch.arange(len(tensors), device=values.device), lengths)
    finite = torch.isfinite(values)
    weights = finite.float()
    count = torch.segment_reduce(weights, "sum", lengths=lengths)
    low = torch.segment_reduce(torch.where(finite, values, math.inf), "min", lengths=lengths)
    high = torch.segment_reduce(torch.where(finite, values, -math.inf), "max", lengths=lengths)
    low = torch.where(count > 0, low, torch.zeros_like(low))
    high = torch.where(count > 0, high, torch.zeros_like(high))
    width = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    clean = torch.where(finite, values, 0.0)
    total = torch.segment_reduce(clean, "sum", lengths=lengths)
    squares = torch.segment_reduce(clean.square(), "sum", lengths=lengths)
    bucket = ((clean - low[segment]) / width[segment] * bins).floor_().clamp_(0, bins - 1).long() + segment * bins
    counts = torch.zeros(len(tensors) * bins, dtype=torch.float32, device=values.device).index_add_(0, bucket, weights)
    return torch.cat([torch.stack([low, high, count, total, squares], dim=1), counts.view(len(tensors), bins)], dim=1)


@torch.no_grad()
def histogram_summaries(tensors: Sequence[torch.Tensor], bins: int = 30) -> torch.Tensor:
    """Per tensor: min, max, count, sum, sum of squares and ``bins`` equal-width bucket counts of its finite values, as
    a float32 ``[len(tensors), 5 + bins]`` tensor, with no host sync (``torch.histc`` reads min/max back on CUDA);
    small tensors together, large ones in chunks that bound the temporary memory.

    >>> histogram_summaries([torch.tensor([0.0, 1.0, 1.0, float("nan")])], bins=2)[0].tolist()
    [0.0, 1.0, 3.0, 2.0, 2.0, 1.0, 2.0]
    """
    if not tensors:
        return torch.zeros(0, len(SUMMARY_FIELDS) + bins, dtype=torch.float32)
    device = tensors[0].device
    rows = torch.empty(len(tensors), len(SUMMARY_FIELDS) + bins, dtype=torch.float32, device=device)
    batches: dict[torch.device, list[list[int]]] = {}
    filled: dict[torch.device, int] = {}
    for index, tensor in enumerate(tensors):
        size = tensor.numel()
        if tensor.is_sparse or tensor.is_complex() or size > HISTOGRAM_SMALL:
            rows[index] = _summary_row(tensor, bins).to(device)
            continue
        batch = batches.setdefault(tensor.device, [[]])
        if filled.get(tensor.device, 0) + size > HISTOGRAM_BATCH:
            batch.append([])
            filled[tensor.device] = 0
        batch[-1].append(index)
        filled[tensor.device] = filled.get(tensor.device, 0) + size
    for groups in batches.values():
        for indices in groups:
            position = torch.tensor(indices, device=device)
            rows.index_copy_(0, position, _summary_rows([tensors[i] for i in indices], bins).to(device))
    return rows


def histogram_from_row(row: Sequence[float], bins: int) -> dict[str, Any]:
    """Host values of one :func:`histogram_summaries` row as ``add_histogram_raw`` keyword arguments (like
    TensorBoard's ``make_histogram``, with the left edge as an empty first bucket).

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
    """``value`` rounded to ``digits`` significant digits.

    >>> round_significant(3.14159), round_significant(1234.5)
    (3.1, 1200.0)
    """
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def suggest_clip_value(healthy_norms: Sequence[float], threshold: float | None, quantile: float = 0.9,
                       minimum_history: int = 3) -> tuple[float | None, str]:
    """A ``gradient_clip_val`` from a high quantile of the run's own recent healthy global norms (normal steps left
    alone, spikes capped), and where it comes from; with too little history the user's threshold, else None (a
    fixed number nobody chose would be a guess).

    >>> suggest_clip_value([1.0, 2.0, 3.0, 4.0], threshold=None)
    (4.0, '90th percentile of the last 4 healthy global gradient norms')
    >>> suggest_clip_value([], threshold=10.0)[0], suggest_clip_value([1.0], threshold=None)[0]
    (10.0, None)
    """
    finite = sorted(v for v in healthy_norms if math.isfinite(v))
    if len(finite) < minimum_history:
        if threshold is None:
            return None, "too few healthy check steps yet to learn a clip value from"
        return threshold, "the gradient_explosion_threshold; too few healthy check steps yet to learn from"
    value = finite[min(len(finite) - 1, int(quantile * len(finite)))]
    return (round_significant(value),
            f"{round(quantile * 100)}th percentile of the last {len(finite)} healthy global gradient norms")


def clip_advice(clip: float | None, basis: str) -> str:
    """The fix an ``exploding_grad`` message gives when the loop does not clip.

    >>> clip_advice(4.0, "the 90th percentile").split(" or ")[0]
    'Clip the gradient norm at 4 (the 90th percentile): Trainer(gradient_clip_val=4)'
    >>> clip_advice(None, "too few healthy check steps").split(" or ")[0]
    'Clip the gradient norm (no value suggested: too few healthy check steps): Trainer(gradient_clip_val=...)'
    """
    how = ("torch.nn.utils.clip_grad_norm_; lower the learning rate, normalize the inputs and check the "
           "initialization.")
    if clip is None:
        return f"Clip the gradient norm (no value suggested: {basis}): Trainer(gradient_clip_val=...) or {how}"
    return f"Clip the gradient norm at {clip:g} ({basis}): Trainer(gradient_clip_val={clip:g}) or {how}"


GRAPH_NODES_WALKED = 100_000


def loss_reaches(loss: torch.Tensor, params: Sequence[torch.Tensor], limit: int = GRAPH_NODES_WALKED) -> bool:
    """Whether a backward from ``loss`` can reach one of ``params``: its autograd graph (:func:`graph_reach`, still
    walkable after the backward, which frees only the saved tensors) holds the gradient accumulator of one of them.
    Walked only when no parameter got a gradient; a graph of ``limit`` nodes or more counts as reaching::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> loss = (weight * 3).sum()
        >>> rebuilt = torch.tensor(loss.item(), requires_grad=True) / 1
        >>> loss_reaches(loss, [weight]), loss_reaches(rebuilt, [weight]), loss_reaches(loss.detach(), [weight])
        (True, False, False)
    """
    nodes = graph_reach(loss.grad_fn, limit)
    wanted = {id(param) for param in params}
    return len(nodes) >= limit or any(id(getattr(node, "variable", None)) in wanted for node in nodes)
