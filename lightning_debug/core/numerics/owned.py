"""Which slots' squares this rank contributes to the sums over every process.

Example::

    >>> import torch
    >>> Owned([True, True], torch.device("cpu")).every, Owned([False], torch.device("cpu")).none
    (True, True)
"""

from __future__ import annotations

import torch

from lightning_debug.core.numerics.rows import constant


class Owned:
    """Which slots' squares this rank adds to the sums over every process (see
    :func:`~lightning_debug.checks.numerics.owns_block`), with the two common cases, every slot (one
    process) and none (a replica), known on the host so that they cost no device work.

    Example::

        >>> squares = torch.tensor([1.0, 4.0], dtype=torch.float64)
        >>> terms, total = Owned([True, False], squares.device).terms(squares, squares.sum())
        >>> terms.tolist(), float(total)
        ([1.0, 0.0], 1.0)
    """

    def __init__(self, owned: list[bool], device: torch.device) -> None:
        self.mask = torch.tensor(owned, dtype=torch.bool, device=device)
        self.every = all(owned)
        self.none = bool(owned) and not any(owned)

    def terms(self, squares: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned part of ``squares`` (zeros elsewhere) and its sum, given ``total``, the sum of all."""
        if self.every:
            return squares, total
        zero = constant(0.0, squares.device)
        if self.none:
            return torch.zeros_like(squares), zero
        terms = torch.where(self.mask, squares, zero)
        return terms, terms.sum()
