"""A check step between its measurement on the device and the moment its values are on the host: nothing here
syncs (snapshots, weight distances and histograms are non-blocking :class:`~lightning_debug.core.readback.Readback`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from lightning_debug.checks.gradients import histogram_from_row, histogram_summaries
from lightning_debug.core.metrics import metric_part
from lightning_debug.core.monitor import HistogramWriter
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where
from lightning_debug.core.numerics import HostNumerics, ParameterIndex
from lightning_debug.monitors.gradients.layout import ModuleLayout

HISTOGRAM_BINS = 30
MAX_PENDING_CHECKS = 4


@dataclass
class PendingCheck:
    """One check step until all its values are on the host::

        >>> pending = PendingCheck(4, {"epoch": 0, "batch": 4})
        >>> pending.ready()
        False
    """

    step: int
    where: Where
    host: HostNumerics | None = None
    snapshot: list[torch.Tensor] = field(default_factory=list)
    index: ParameterIndex | None = None
    update_expected: bool = False
    update: Readback | None = None
    had_grad: list[bool] = field(default_factory=list)
    lr_zero_now: list[bool] = field(default_factory=list)
    layout: ModuleLayout | None = None
    judged: ParameterIndex | None = None
    histograms: list[tuple[str, list[str], Readback]] = field(default_factory=list)
    outside_with_grad: list[str] = field(default_factory=list)
    backward: bool | None = None
    """None when no backward of this step ran before it, else whether its loss reaches a parameter."""
    early: bool = False
    """One of the run's first steps (:data:`.exploding.EARLY_STEPS`): its norm joins those the next ones are judged
    against."""

    def ready(self) -> bool:
        return (self.host is not None and not (self.update_expected and self.update is None)
                and (self.update is None or self.update.ready())
                and all(readback.ready() for _, _, readback in self.histograms))

    def snapshot_weights(self, index: ParameterIndex, layout: ModuleLayout | None, lr_zero_now: list[bool]) -> None:
        """Copy the weights before the optimizer step (fused, on the device) to measure its update after it."""
        self.index, self.layout, self.lr_zero_now = index, layout, lr_zero_now
        self.snapshot = index.plan.snapshot(index.params)
        self.update_expected = True

    def measure_update(self) -> None:
        """``||Δw||`` of the parameters since the snapshot, read back later (no sync)."""
        index = self.index
        assert index is not None
        self.had_grad = [p.grad is not None for p in index.params]
        self.update = Readback(index.plan.distance_squares(self.snapshot, index.params).sqrt(), blocking=False)
        self.snapshot, self.index = [], None

    def capture_histograms(self, index: ParameterIndex, gradients: bool, weights: bool) -> None:
        """Gradient and weight histograms of every parameter, in fused operations, read back later."""
        if gradients:
            grads = [p.grad for p in index.params]
            names = [name for name, grad in zip(index.names, grads) if grad is not None]
            if names:
                self.histograms.append(("debug/grad_hist/", names, Readback(histogram_summaries(
                    [grad for grad in grads if grad is not None], HISTOGRAM_BINS).reshape(-1), blocking=False)))
        if weights and len(index):
            self.histograms.append(("debug/weight_hist/", index.names, Readback(
                histogram_summaries(index.params, HISTOGRAM_BINS).reshape(-1), blocking=False)))

    def write_histograms(self, writer: HistogramWriter | None) -> None:
        if writer is None or not self.histograms:
            return
        width = 5 + HISTOGRAM_BINS
        for prefix, names, readback in self.histograms:
            values = readback.values()
            for index, name in enumerate(names):
                writer(prefix + metric_part(name), histogram_from_row(values[index * width:(index + 1) * width],
                                                                      HISTOGRAM_BINS), self.step)


class PendingChecks:
    """The check steps waiting for their values, and the one whose weight update is still to be measured::

        >>> checks = PendingChecks()
        >>> checks.add(PendingCheck(0, {})); checks.add(PendingCheck(1, {}))
        >>> [p.step for p in checks.ready(final=True)], checks.waiting
        ([], {})
    """

    def __init__(self) -> None:
        self.waiting: dict[int, PendingCheck] = {}
        self.awaiting_update: PendingCheck | None = None

    def add(self, pending: PendingCheck) -> None:
        self.waiting[pending.step] = pending

    def drop(self, step: int) -> None:
        pending = self.waiting.pop(step, None)
        if pending is not None and pending is self.awaiting_update:
            self.awaiting_update = None

    def ready(self, final: bool = False) -> Iterator[PendingCheck]:
        """Each check step whose values have all arrived, in order, taken out: a step waits for its update and
        histograms while fewer than :data:`MAX_PENDING_CHECKS` are pending (``final``: not at all). A step without
        values behind one that has them lost them, and is dropped::

            >>> checks = PendingChecks()
            >>> checks.add(PendingCheck(0, {})); checks.add(PendingCheck(1, {}))
            >>> checks.waiting[1].host = object()  # step 0's values were lost on their way
            >>> [p.step for p in checks.ready()], checks.waiting
            ([1], {})
        """
        while self.waiting:
            step = min(self.waiting)
            pending = self.waiting[step]
            if pending.host is None and not final:
                if not any(later.host is not None for later in self.waiting.values() if later.step > step):
                    return
                self.drop(step)  # its values were lost (a failure while they were handed over): later steps go on
                continue
            if pending.host is not None and not (final or pending.ready() or len(self.waiting) > MAX_PENDING_CHECKS):
                return
            self.drop(step)
            if pending.host is not None:
                yield pending

    def clear(self) -> None:
        self.waiting, self.awaiting_update = {}, None
