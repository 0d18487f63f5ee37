"""The decision policy: from what a checked step shows, which kinds it has and what the run does about it.
``nonfinite_input`` alone decides nothing (the loss it leads to does), nor does a GradScaler's overflow;
broken weights stop a ``skip`` run too, since skipping later steps cannot repair them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_debug.checks.localize import Cause, CauseSite
from lightning_debug.config import AnomalyMode
from lightning_debug.core.kinds import Kind

if TYPE_CHECKING:
    from lightning_debug.monitors.anomaly.forensics import ParamsOrigin

DECIDING = frozenset({Kind.NONFINITE_LOSS, Kind.NONFINITE_GRAD, Kind.NONFINITE_PARAM, Kind.NONFINITE_ACTIVATION,
                      Kind.NONFINITE_BUFFER})


class Action(enum.Enum):
    """What the run does with a checked optimizer step."""

    CONTINUE = "continue"
    RAISE = "raise"
    SKIP = "skip"
    STOP = "stop"


@dataclass
class Verdict:
    """What one checked step shows, before anything is written: the same on every rank::

        >>> overflow = Verdict([], [("w", float("inf"))], [], True, 3, [], [])
        >>> overflow.amp_overflow, overflow.kinds(None)
        (True, [<Kind.AMP_OVERFLOW_SKIPPED: 'amp_overflow_skipped'>])
        >>> Verdict([0], [("w", float("nan"))], [], False, 3, [0], []).kinds(None)
        [<Kind.NONFINITE_INPUT: 'nonfinite_input'>, <Kind.NONFINITE_LOSS: 'nonfinite_loss'>, <Kind.NONFINITE_GRAD: 'nonfinite_grad'>]
    """

    bad_loss_ranks: list[int]
    bad_grads: list[tuple[str, float]]
    bad_params: list[tuple[str, float]]
    uses_grad_scaler: bool
    last_finite_param_step: int
    bad_input_ranks: list[int]
    input_rows: list[dict[str, Any]]
    params: ParamsOrigin | None = None
    bad_buffer_ranks: list[int] = field(default_factory=list)  # buffers NaN/Inf after the forward (BatchNorm's)
    bad_buffers: list[tuple[str, str]] = field(default_factory=list)  # this rank's, with their module's class

    @property
    def amp_overflow(self) -> bool:
        """fp16 overflow the GradScaler handles: how a healthy run finds its scale, an ``info`` that decides nothing."""
        return self.uses_grad_scaler and bool(self.bad_grads) and not self.bad_loss_ranks and not self.bad_params

    @property
    def finite(self) -> bool:
        """The step's loss, gradients, weights and buffers are finite, whatever its inputs held."""
        return not (self.bad_loss_ranks or self.bad_grads or self.bad_params or self.bad_buffer_ranks)

    @property
    def finite_but_buffers(self) -> bool:
        """The step's loss, gradients and weights are finite: only its buffers are not."""
        return not (self.bad_loss_ranks or self.bad_grads or self.bad_params)

    @property
    def params_first(self) -> bool:
        """The weights this step's forward used were already non-finite: its loss and gradients follow from them."""
        return bool(self.bad_params) and self.params is not None and self.params.before_forward

    def kinds(self, cause: Cause | None) -> list[Kind]:
        """The kinds this step shows; ``nonfinite_input`` alone decides nothing (its loss does)."""
        inputs = [Kind.NONFINITE_INPUT] if self.bad_input_ranks else []
        if self.amp_overflow:
            return [*inputs, Kind.AMP_OVERFLOW_SKIPPED]
        kinds = inputs + ([Kind.NONFINITE_PARAM] if self.bad_params else [])
        if names_activation(cause):
            kinds.append(Kind.NONFINITE_ACTIVATION)
        return kinds + [kind for kind, bad in ((Kind.NONFINITE_LOSS, self.bad_loss_ranks),
                                               (Kind.NONFINITE_GRAD, self.bad_grads),
                                               (Kind.NONFINITE_BUFFER, self.bad_buffer_ranks)) if bad]

    def anomalous(self) -> bool:
        """Whether the step counts as an anomaly (a deciding kind, before any replay)."""
        return not self.finite and bool(deciding(self.kinds(None)))


def names_activation(cause: Cause | None) -> bool:
    """Whether a replay caught one forward operation producing NaN/Inf (a ``nonfinite_activation``)::

        >>> names_activation(Cause(CauseSite.FORWARD, "`torch.log` produced NaN", operation="torch.log"))
        True
        >>> names_activation(Cause(CauseSite.FORWARD, "no single operation produced it"))
        False
    """
    return cause is not None and cause.where is CauseSite.FORWARD and bool(cause.operation)


def deciding(kinds: list[Kind]) -> list[Kind]:
    return [kind for kind in kinds if kind in DECIDING]


def decide(mode: AnomalyMode, kinds: list[Kind]) -> Action:
    """What the run does with a step of ``kinds`` (deciding kinds only) under ``mode``. A healthy step shows no
    deciding kind (the GradScaler's overflow is not one), so it always continues::

        >>> decide(AnomalyMode.SKIP, [Kind.NONFINITE_LOSS]), decide(AnomalyMode.SKIP, [Kind.NONFINITE_PARAM])
        (<Action.SKIP: 'skip'>, <Action.STOP: 'stop'>)
        >>> decide(AnomalyMode.RAISE, []), decide(AnomalyMode.WARN, [Kind.NONFINITE_GRAD])
        (<Action.CONTINUE: 'continue'>, <Action.CONTINUE: 'continue'>)
    """
    if not kinds or mode is AnomalyMode.WARN:
        return Action.CONTINUE
    if mode is AnomalyMode.RAISE:
        return Action.RAISE
    return Action.STOP if mode is AnomalyMode.STOP or Kind.NONFINITE_PARAM in kinds else Action.SKIP


def reads_late(mode: AnomalyMode, replays: bool) -> bool:
    """Whether the step's values can be read a step late without a sync: nothing waits on them::

        >>> reads_late(AnomalyMode.WARN, replays=False), reads_late(AnomalyMode.SKIP, replays=False)
        (True, False)
    """
    return mode is AnomalyMode.WARN and not replays


def restores_buffers(mode: AnomalyMode) -> bool:
    """Whether a dropped step may have to put back the buffers its forward changed (``skip``, ``stop``)."""
    return mode in (AnomalyMode.SKIP, AnomalyMode.STOP)
