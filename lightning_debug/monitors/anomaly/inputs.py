"""The batches of recent check steps, kept by reference (no copy, no read) to name the samples that hold NaN/Inf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_debug.checks.batches import nonfinite_samples
from lightning_debug.core.session import Where

INPUT_STEPS_KEPT = 8
InputRows = list[tuple[Where, list[tuple[str, torch.Tensor]]]]


class RecentInputs:
    """The floating tensors of the micro-batches of the last observed steps::

        >>> recent = RecentInputs(kept=2)
        >>> for step in range(3): recent.add(step, {"epoch": 0, "batch": step}, [("x", torch.zeros(1))])
        >>> sorted(recent.steps), len(recent.take(2)), recent.steps
        ([1, 2], 1, {})
    """

    def __init__(self, kept: int = INPUT_STEPS_KEPT) -> None:
        self.kept = kept
        self.steps: dict[int, InputRows] = {}

    def add(self, step: int, where: Where, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.steps.setdefault(step, []).append((where, tensors))
        while len(self.steps) > self.kept:
            self.steps.pop(min(self.steps))

    def take(self, step: int) -> InputRows:
        """The inputs of ``step``, forgetting them and those of every earlier step."""
        inputs = self.steps.pop(step, [])
        self.steps = {later: rows for later, rows in self.steps.items() if later > step}
        return inputs


def nonfinite_rows(inputs: InputRows, rank: int, world_size: int, synchronous: bool,
                   on_failure: Callable[[Exception], None],
                   gather: Callable[[Callable[[], Any]], list[Any]]) -> list[dict[str, Any]]:
    """Which tensor of which micro-batch holds NaN/Inf, and which samples (a host read, rare path). Read
    synchronously, every rank's rows are gathered whatever failed on this one; read a step late, only its own::

        >>> x = torch.tensor([[1.0], [float("nan")]])
        >>> nonfinite_rows([({"epoch": 0, "batch": 3}, [("x", x)])], 0, 1, True, print, print)
        [{'tensor': 'x', 'shape': [2, 1], 'samples': [1], 'count': 1, 'epoch': 0, 'batch': 3, 'rank': 0}]
    """
    found: list[dict[str, Any]] = []
    try:
        for batch_where, tensors in inputs:
            for name, tensor in tensors:
                samples, count = nonfinite_samples(tensor)
                if count:
                    found.append({"tensor": name, "shape": list(tensor.shape), "samples": samples, "count": count,
                                  "epoch": batch_where.get("epoch", -1), "batch": batch_where.get("batch", -1)})
    except Exception as error:  # still join the gather below
        found = []
        on_failure(error)
    per_rank = {rank: found}
    if synchronous and world_size > 1 and dist.is_available() and dist.is_initialized():
        per_rank = {rank: rows or [] for rank, rows in enumerate(gather(lambda: found))}
    return [dict(row, rank=rank) for rank, rank_rows in sorted(per_rank.items()) for row in rank_rows]
