"""``repeated_batch``: the data loader hands the model the same batch more than once within an epoch.

Data-loader workers that share one random state draw the same records, silently. On a healthy model: an epoch
starts the data over, so only batches of one epoch are compared; tiny batches can agree by chance (under
:data:`MIN_VALUES` values are not judged); one chance repeat is not enough (:data:`MIN_REPEATS` in a window, two
windows in a row)::

    >>> import torch
    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> engine, x = VerdictEngine(), torch.arange(64.0)
    >>> prints = [batch_fingerprint((x + k // 2, torch.zeros(4))).tolist() for k in range(8)]  # each batch twice
    >>> repeated_batches([(0, p) for p in prints])
    4
    >>> [judge_repeats(step, 4, 8, engine) is not None for step in (0, 100)]
    [False, True]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_debug.checks.batches import named_tensors
from lightning_debug.checks.tensors import real_values
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.readback import Readback
from lightning_debug.core.verdicts import Suspicion, VerdictEngine

WINDOW = 8  # batches fingerprinted from each gradient check step on
MIN_REPEATS = 2  # N workers sharing a seed repeat N-1 of every N
MIN_VALUES = 64
SAMPLED = 16  # values at fixed positions of each tensor in its fingerprint, besides its sums
PERIOD = 251  # a prime: the weights of the weighted sum repeat after it, out of step with any image's size
WINDOW_EVERY = 100  # optimizer steps at least between two windows (checks every step: not back to back)
KEY = "batches"


def batch_fingerprint(batch: Any) -> torch.Tensor | None:
    """A float64 vector two different batches practically never share: per tensor its sum, a sum weighted by the
    position modulo :data:`PERIOD` and :data:`SAMPLED` spread values (no host read; None under :data:`MIN_VALUES`
    values).

    Binary images with a constant border (binarized MNIST, a GAN's masks) are why the weighted sum is there: the
    spread values fall on the same border pixel of every batch, and the plain sum, a count of pixels on, is one of a
    few hundred values, so two batches of eight shared it about every other window. The weighted sum mixes every
    position into one value::

        >>> a = batch_fingerprint({"x": torch.ones(8, 8), "y": torch.arange(8)})
        >>> bool((a == batch_fingerprint({"x": torch.ones(8, 8), "y": torch.arange(8)})).all()), a.shape
        (True, torch.Size([28]))
        >>> batch_fingerprint(torch.arange(4)) is None
        True
    """
    tensors = [t.detach() for _, t in named_tensors(batch) if not t.is_sparse and t.numel() > 0]
    if sum(t.numel() for t in tensors) < MIN_VALUES:
        return None
    parts = []
    for tensor in tensors:
        flat = real_values(tensor)
        exact = torch.float32 if flat.device.type == "mps" else torch.float64  # MPS has no float64
        stride = max(1, flat.numel() // SAMPLED)
        picked = flat[::stride][:SAMPLED].to(exact)
        parts.append(torch.cat([flat.sum(dtype=exact).reshape(1), weighted_sum(flat, exact).reshape(1), picked]))
    return torch.cat([part.to(parts[0].device) for part in parts])


def weighted_sum(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum(flat[i] * (1 + i % PERIOD))`` without a weight per value: the column sums of the whole rows of
    :data:`PERIOD` values, then the rest::

        >>> x = torch.arange(600, dtype=torch.float64)
        >>> weighted_sum(x, torch.float64).item() == (x * (1 + torch.arange(600) % PERIOD)).sum().item()
        True
    """
    rows = flat.numel() // PERIOD
    weights = torch.arange(1, PERIOD + 1, dtype=dtype, device=flat.device)
    tail = flat[rows * PERIOD:].to(dtype)
    total = (tail * weights[:tail.numel()]).sum()
    if rows:
        total = total + (flat[:rows * PERIOD].reshape(rows, PERIOD).sum(0, dtype=dtype) * weights).sum()
    return total


def repeated_batches(window: Sequence[tuple[Any, Sequence[float]]]) -> int:
    """How many batches of ``window`` ((epoch, fingerprint) in order) equal an earlier one of the same epoch::

        >>> repeated_batches([(0, [1.0]), (0, [1.0]), (1, [1.0]), (1, [2.0])])
        1
    """
    keys = [(epoch, tuple(values)) for epoch, values in window]
    return len(keys) - len(set(keys))


def judge_repeats(step: int, repeats: int, judged: int, verdicts: VerdictEngine) -> Finding | None:
    """The ``repeated_batch`` finding of the window opened at ``step``, once the kind's policy confirms it."""
    suspicions = [Suspicion(Kind.REPEATED_BATCH, KEY, step, measured={"repeats": repeats, "judged": judged})] \
        if repeats >= MIN_REPEATS else []
    confirmed = verdicts.observe(Kind.REPEATED_BATCH, step, suspicions)
    if not confirmed:
        return None
    since = confirmed[0].first.step
    return Finding(
        Kind.REPEATED_BATCH, Severity.WARNING,
        f"The data loader repeats batches: of the {judged} batches that followed check step {step}, {repeats} were "
        f"identical to an earlier one of the same epoch (also after step {since}). Data-loader workers that share one "
        "random state (a NumPy/Python generator made in the dataset's __init__, copied into every worker) draw the "
        "same records, so each batch is trained on several times and most of the data never: seed each worker "
        "(worker_init_fn, or draw with torch's generator, which the DataLoader seeds per worker).",
        {"repeats": repeats, "batches": judged, "window": WINDOW, "since_step": since})


class BatchWindow:
    """The fingerprints of the batches that follow one check step, read back without a sync::

        >>> window = BatchWindow()
        >>> for step in range(10): window.add(step, step == 0, 0, torch.full((8, 8), float(step // 2)))
        >>> window.take()
        (0, 4, 8, None)
        >>> window.take() is None
        True
    """

    def __init__(self) -> None:
        self.opened_at: int | None = None
        self.last_opened: int | None = None
        self.where: Any = None
        self._prints: list[tuple[Any, Readback]] = []
        self._done: list[tuple[int, Any, list[tuple[Any, Readback]]]] = []

    @property
    def collecting(self) -> bool:
        return self.opened_at is not None

    def add(self, step: int, due: bool, epoch: Any, batch: Any, where: Any = None) -> None:
        """A training batch of ``step`` (``due``: a check step, which opens a window)."""
        if self.opened_at is None:
            if not due or (self.last_opened is not None and 0 <= step - self.last_opened < WINDOW_EVERY):
                return
            self.opened_at, self.last_opened, self.where, self._prints = step, step, where, []
        fingerprint = batch_fingerprint(batch)
        if fingerprint is not None:
            self._prints.append((epoch, Readback(fingerprint, blocking=False)))
        if len(self._prints) >= WINDOW or fingerprint is None:
            if len(self._prints) >= WINDOW:
                self._done.append((self.opened_at, self.where, self._prints))
            self.opened_at, self._prints = None, []

    def take(self, final: bool = False) -> tuple[int, int, int, Any] | None:
        """(check step, repeats, batches judged, where) of the oldest complete window read back (or ``final``)."""
        if not self._done or not (final or all(readback.ready() for _, readback in self._done[0][2])):
            return None
        step, where, prints = self._done.pop(0)
        return step, repeated_batches([(epoch, readback.values()) for epoch, readback in prints]), len(prints), where

    def clear(self) -> None:
        self.opened_at, self.last_opened, self._prints, self._done = None, None, [], []


__all__ = ["MIN_REPEATS", "WINDOW", "BatchWindow", "batch_fingerprint", "judge_repeats", "repeated_batches"]
