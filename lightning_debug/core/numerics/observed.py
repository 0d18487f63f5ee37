"""What the forward of an optimizer step showed before its gradients existed (losses, batch extremes).

Example::

    >>> seen = Observed()
    >>> seen.add_loss(torch.tensor([1.0, 3.0]))
    >>> float(seen.loss_sum), seen.loss_count, seen.input_ends()
    (2.0, 1, None)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch


class Observed:
    """What the forward of an optimizer step showed before its gradients existed, as device values
    (no sync): the sum of its micro-batch losses, and the extremes of its batches' floating tensors.

    Sums and extremes carry NaN/Inf through, so one value per quantity is all the step needs; the
    host tells finiteness after the read-back
    (:func:`~lightning_debug.core.numerics.rows.rank_flags`). Extremes, not sums, for the batches: a
    mask filled with ``torch.finfo(dtype).min`` is finite and must not overflow into a false alarm.

    Example::

        >>> seen = Observed()
        >>> seen.add_loss(torch.tensor(2.0)); seen.add_loss(torch.tensor(4.0))
        >>> seen.add_inputs([torch.tensor([1.0, float("nan")])])
        >>> float(seen.loss_sum), seen.loss_count, [float(end) for end in seen.input_ends()]
        (6.0, 2, [nan, nan])
    """

    __slots__ = ("loss_sum", "loss_count", "_ends", "input_count", "buffer_high", "_losses")

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self._ends: list[torch.Tensor] = []
        self.input_count = 0
        self.buffer_high: torch.Tensor | None = None
        """The largest magnitude over the model's buffers after the step's last forward (NaN/Inf if one holds it)."""
        self._losses: list[weakref.ref[torch.Tensor]] = []

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss; the same tensor given again (by a second monitor) counts once.

        Example::

            >>> seen, loss = Observed(), torch.tensor(3.0)
            >>> seen.add_loss(loss); seen.add_loss(loss)
            >>> seen.loss_count
            1
        """
        if any(seen() is loss for seen in self._losses):
            return
        self._losses.append(weakref.ref(loss))
        value = loss.detach().double()
        if value.dim():
            value = value.mean()
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value.to(self.loss_sum.device)
        self.loss_count += 1

    def add_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Floating or complex tensors (a complex one is read as its real and imaginary parts, a view)."""
        for tensor in tensors:
            values = tensor.detach()
            if values.is_complex():
                values = torch.view_as_real(values.resolve_conj())
            self._ends.extend(torch.aminmax(values))
        self.input_count += len(tensors)

    def input_ends(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The smallest and the largest value over every observed batch tensor (NaN if any holds one)."""
        ends = self._ends
        if len(ends) <= 2:
            return (ends[0], ends[1]) if ends else None
        first = ends[0]
        if not all(end.dtype == first.dtype and end.device == first.device for end in ends):
            device = next((end.device for end in ends if end.device.type != "cpu"), first.device)  # never read a GPU value
            ends = [end.to(device, torch.float64, non_blocking=True) for end in ends]
        low, high = torch.aminmax(torch.stack(ends))
        return low, high
