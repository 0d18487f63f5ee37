"""The global gradient norm of the few optimizer steps after a suspected jump, measured without a sync.

A jump of the global norm on a check step is judged by the steps after it (see
:data:`~lightning_debug.monitors.gradients.exploding.FOLLOW_UP_STEPS`). Where those steps are not check
steps themselves, this measures only their global norm: one fused norm over the gradients of the index
the check step used, on the process that reports, read back when the copy has completed. Nothing is
measured unless a jump waits, and no collective is issued: under DDP every rank holds the same reduced
gradients; for sharded parameters (whose norm needs every rank) no follow-up is measured and the jump is
decided by the check steps after it.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_debug.core.numerics import ParameterIndex
    >>> layer = nn.Linear(3, 1)
    >>> layer(torch.ones(2, 3)).sum().backward()
    >>> follow_ups = FollowUps()
    >>> follow_ups.want("adam", ParameterIndex(list(layer.named_parameters())))
    >>> follow_ups.measure(5, "adam", lambda: None)
    >>> [(step, optimizer, round(norm, 3)) for step, optimizer, norm in follow_ups.read(final=True)]
    [(5, 'adam', 4.0)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_debug.checks.numerics import fused_norms
from lightning_debug.core.numerics import ParameterIndex
from lightning_debug.core.readback import Readback
from lightning_debug.core.kinds import Kind
from lightning_debug.core.verdicts import Confirmed, Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.exploding import FOLLOW_UP_STEPS, OVERFLOW
from lightning_debug.monitors.gradients.verdict import Verdict

Decided = list[tuple[int, Verdict, Any]]


class FollowUps:
    """Which optimizers' next steps to measure, and the readings on their way to the host (bounded:
    :data:`FOLLOW_UP_STEPS` per optimizer)."""

    def __init__(self) -> None:
        self._wanted: dict[Any, tuple[ParameterIndex, int]] = {}
        self._readings: list[tuple[int, Any, Readback]] = []

    def __bool__(self) -> bool:
        """Whether a step is wanted or a reading is on its way."""
        return bool(self._wanted) or bool(self._readings)

    def want(self, optimizer: Any, index: ParameterIndex | None) -> None:
        """Measure the next :data:`FOLLOW_UP_STEPS` non-check steps of ``optimizer`` over ``index``."""
        if index is not None and not index.sharded and len(index):
            self._wanted[optimizer] = (index, FOLLOW_UP_STEPS)

    def measure(self, step: int, optimizer: Any, grad_scale: Callable[[], torch.Tensor | None]) -> None:
        """Queue the global norm of this (non-check) optimizer step's gradients, if one is wanted."""
        entry = self._wanted.get(optimizer)
        if entry is None:
            return
        index, left = entry
        if left <= 1:
            del self._wanted[optimizer]
        else:
            self._wanted[optimizer] = (index, left - 1)
        grads, _ = index.local_grads()
        norm = fused_norms(grads).double().square().sum().sqrt()
        scale = grad_scale()
        if scale is not None:
            norm = norm / scale.detach().to(device=norm.device, dtype=norm.dtype)
        self._readings.append((step, optimizer, Readback(norm, blocking=False)))

    def pending(self, final: bool = False) -> bool:
        """Whether a reading can be taken now."""
        return bool(self._readings) and (final or self._readings[0][2].ready())

    def read(self, final: bool = False) -> Iterator[tuple[int, Any, float]]:
        """``(step, optimizer, global norm)`` of each reading that has reached the host, in order."""
        while self._readings and (final or self._readings[0][2].ready()):
            step, optimizer, reading = self._readings.pop(0)
            yield step, optimizer, reading.values()[0]

    def clear(self) -> None:
        self._wanted.clear()


class Explosions:
    """Per optimizer, the jumps waiting for the steps after them (held in the verdict engine under the kind's
    policy, see :data:`.FOLLOW_UP_STEPS`) and the follow-up readings that decide them; what the gradient monitor
    records is what this returns.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from lightning_debug.core.findings import Finding
        >>> from lightning_debug.core.kinds import Kind, Severity
        >>> from lightning_debug.core.numerics import ParameterIndex
        >>> layer = nn.Linear(3, 1)
        >>> layer(torch.ones(2, 3)).sum().backward()
        >>> explosions, index = Explosions(VerdictEngine()), ParameterIndex(list(layer.named_parameters()))
        >>> jump = Verdict(Finding(Kind.EXPLODING_GRAD, Severity.WARNING, "", {"limit": 1.0}))
        >>> explosions.judge(4, None, 40.0, jump, True, {}, index)
        []
        >>> explosions.measure(5, None, lambda: None, lambda optimizer: index)
        >>> explosions.measure(6, None, lambda: None, lambda optimizer: index)
        >>> [step for step, _, _ in explosions.read(final=True)]
        [4]
    """

    def __init__(self, verdicts: VerdictEngine) -> None:
        self.verdicts = verdicts
        self.follow_ups = FollowUps()
        self._rearm = False

    @property
    def measuring(self) -> bool:
        """Whether a non-check step has anything to measure (one attribute test on every other step)."""
        return self._rearm or bool(self.follow_ups)

    def judge(self, step: int, optimizer: Any, global_norm: float, verdict: Verdict | None, deferred: bool,
              where: Any, index: ParameterIndex | None) -> Decided:
        """A check step's global norm (it also follows earlier jumps) and its own verdict: recorded at once,
        or, for a jump judged against the run's history (``deferred``), waiting for the steps after it. A norm
        that overflowed right after a jump it confirms is that explosion, already named where it began."""
        jump = None
        if verdict is not None and deferred:
            details = verdict.finding.details
            jump = Suspicion(Kind.EXPLODING_GRAD, str(step), step, verdict.finding, verdict.flagged, where,
                             value=global_norm, bound=float(details.get("confirm_above") or details["limit"]))
        decided = self._decided(self.verdicts.observe(Kind.EXPLODING_GRAD, step, [jump] if jump else [],
                                                      scope=str(optimizer), reading=global_norm))
        if jump is not None:
            self.follow_ups.want(optimizer, index)
        elif verdict is not None:
            if decided and verdict.finding.details.get("judged_by") == OVERFLOW:
                return decided  # the non-finite step confirmed the jump it follows: named where that began
            decided.append((step, verdict, where))
        return decided

    def measure(self, step: int, optimizer: Any, grad_scale: Callable[[], torch.Tensor | None],
                index: Callable[[Any], ParameterIndex]) -> None:
        """A non-check step after a jump: queue its global norm."""
        if self._rearm:  # resumed while a jump waited: the index its check step used is built again
            self._rearm = False
            if self.verdicts.holding(Kind.EXPLODING_GRAD, str(optimizer)):
                self.follow_ups.want(optimizer, index(optimizer))
        self.follow_ups.measure(step, optimizer, grad_scale)

    def read(self, final: bool = False) -> Decided:
        """The jumps decided by the readings that reached the host (``final``: all of them, then every jump
        still waiting)."""
        decided: Decided = []
        if self.follow_ups.pending(final):
            for step, optimizer, norm in self.follow_ups.read(final):
                decided += self._decided(self.verdicts.observe(Kind.EXPLODING_GRAD, step, scope=str(optimizer),
                                                               reading=norm))
            if not self.verdicts.holding(Kind.EXPLODING_GRAD):
                self.follow_ups.clear()
        if final:
            decided += self._decided(self.verdicts.flush([Kind.EXPLODING_GRAD]))
        return decided

    def resumed(self) -> None:
        """A checkpoint was loaded: jumps held in it are measured again from the next step on."""
        self._rearm = self.verdicts.holding(Kind.EXPLODING_GRAD)

    @staticmethod
    def _decided(confirmed: list[Confirmed]) -> Decided:
        return [(c.steps[0], Verdict(c.first.finding, c.first.flagged), c.first.where)
                for c in confirmed if c.first.finding is not None]
