"""One rank's row of the shared gradient pass: what it packs, how the host reads its flags.

Every rank packs its loss, batch extremes and gradient sums into a row of float64 values; one
all-reduce sums the rows of every rank (each in its own place) and the host derives the flags from
the finiteness of the raw sums, so the device does no comparison and no sync of its own.

Example::

    >>> rank_flags([1, 0, 0, 2.0, 0, 0, 4.0, 4.0, 0, 0])["loss_value"], world_position()
    (2.0, (0, 1))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# One row per rank, raw values whose finiteness is the flag (the host derives the flags, see
# ``rank_flags``); the packing follows this list. The counts and ``check_failed`` are Python numbers,
# which travel in the row only when there is a collective to carry them.
HOST_FIELDS = ("loss_count", "input_count", "check_failed")
DEVICE_FIELDS = ("loss_sum", "input_low", "input_high", "grad_local_sum", "grad_square_sum", "param_local_sum",
                 "buffer_high")
RANK_FIELDS = HOST_FIELDS + DEVICE_FIELDS
AllGather = Callable[[torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], Any]


_constants: dict[tuple[torch.device, float | str], torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """A shared 0-d float64 tensor holding ``value`` on ``device``, created once (never written to)."""
    key = (device, value if value == value else "nan")  # NaN equals no key, not even itself
    tensor = _constants.get(key)
    if tensor is None:
        tensor = _constants[key] = torch.full((), value, dtype=torch.float64, device=device)
    return tensor


def rank_flags(row: Sequence[float]) -> dict[str, float]:
    """The flags of one rank's row (:data:`RANK_FIELDS` order): a sum that is not finite is the sign
    that one of its terms is not (NaN and infinities propagate; float64 sums of float32 values do not
    overflow), so the device packs raw sums and the host tells.

    Example::

        >>> flags = rank_flags([1, 0, 0, float("nan"), 0, 0, 4.0, 4.0, 0, float("inf")])
        >>> flags["loss_finite"], flags["input_nonfinite"], flags["grad_nonfinite"], flags["loss_value"]
        (0.0, -1.0, 0.0, nan)
        >>> flags["buffer_nonfinite"]
        1.0
    """
    loss_count, input_count, failed, loss_sum, low, high, grad_local, grad_owned, param_local, buffer_high = row
    loss_finite = math.isfinite(loss_sum)
    return {"loss_finite": -1.0 if not loss_count else float(loss_finite),
            "grad_nonfinite": float(not math.isfinite(grad_local)),
            "param_nonfinite": float(not math.isfinite(param_local)),
            "buffer_nonfinite": float(not math.isfinite(buffer_high)),
            "grad_square_sum": grad_owned,
            "input_nonfinite": -1.0 if not input_count else float(not (math.isfinite(low) and math.isfinite(high))),
            "check_failed": failed,
            "loss_value": loss_sum / loss_count if loss_count and loss_finite else math.nan}


def world_position() -> tuple[int, int]:
    """This process's rank and the number of processes of the default (WORLD) group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
