"""The device side of :mod:`.forensics`, only after a risky update: one fused pass over the weights left on the
device, read only if the step turns out non-finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_debug.core.numerics import ParameterIndex


class WeightProbe:
    """The last step whose weights were flagged before its forward, and the flag (a device tensor)::

        >>> probe = WeightProbe()
        >>> probe.step, probe.flag(0)
        (-1, None)
    """

    def __init__(self) -> None:
        self._before: tuple[int, torch.Tensor | None] = (-1, None)
        self._largest: dict[int, float] = {}

    @property
    def step(self) -> int:
        return self._before[0]

    def flag(self, step: int) -> torch.Tensor | None:
        """The flag of ``step``, None if not measured."""
        return self._before[1] if self._before[0] == step else None

    def measure(self, step: int, index: ParameterIndex) -> None:
        if len(index):
            self._before = (step, (~torch.isfinite(index.plan.squares(index.local_params()))).any())

    def largest_value(self, index: ParameterIndex) -> float:
        """The largest finite value of the parameters' smallest floating dtype (cached)."""
        cached = self._largest.get(id(index))
        if cached is None:
            dtypes = {p.dtype for p in index.params if p.is_floating_point()}
            cached = min((torch.finfo(dtype).max for dtype in dtypes), default=torch.finfo(torch.float32).max)
            self._largest = {id(index): cached}
        return cached
