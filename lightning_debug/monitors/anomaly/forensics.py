"""Which optimizer update made the weights non-finite, and whether its gradients did: a scan alone cannot tell,
the earlier checks can. Host arithmetic over a few numbers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# An update moves an element by at most about lr x gradient norm x this (momentum, Adam's normalisation).
UPDATE_GROWTH = 10.0
# An update that reaches this fraction of the dtype's largest value may overflow it.
OVERFLOW_MARGIN = 0.5
# The smallest largest-finite-value of torch's floating dtypes (float8_e4m3fnuz): an update below its margin
# cannot overflow any of them, so the parameters' dtype need not be looked up.
SMALLEST_DTYPE_MAX = 240.0


@dataclass
class ParamsOrigin:
    """When and why the parameters of a checked step became non-finite: ``update_step`` (None: not known),
    ``by_gradients`` (a consequence of ``nonfinite_grad``), ``before_forward`` (the step's loss and gradients
    follow from them), ``label``: the step the finding is recorded at::

        >>> ParamsOrigin.unknown(7).since
        'before step 7'
    """

    label: int
    update_step: int | None
    by_gradients: bool
    before_forward: bool
    since: str

    @classmethod
    def unknown(cls, step: int) -> ParamsOrigin:
        return cls(step, None, False, False, f"before step {step}")


@dataclass(frozen=True)
class LastCheck:
    """The last checked step."""

    step: int = -1
    grads_bad: bool = False
    grad_norm: float = math.nan


def update_may_overflow(grad_norm: float, learning_rates: Sequence[float], largest_value: Callable[[], float]) -> bool:
    """Whether an update with finite gradients could reach the dtype's largest value: only for an absurd learning
    rate or norm::

        >>> update_may_overflow(1e3, [1e3], lambda: 65504.0), update_may_overflow(2.0, [1e-3], lambda: 65504.0)
        (True, False)
    """
    if not math.isfinite(grad_norm) or not learning_rates:
        return False
    lr = max((abs(lr) for lr in learning_rates if math.isfinite(lr)), default=0.0)
    reach = lr * max(grad_norm, 1.0) * UPDATE_GROWTH
    return reach >= OVERFLOW_MARGIN * SMALLEST_DTYPE_MAX and reach >= OVERFLOW_MARGIN * largest_value()


class WeightHistory:
    """What the earlier checks said about the weights. Nothing here fires on a healthy model: :meth:`origin` runs once
    a scan found non-finite weights, :meth:`wants_measure_before` only after an update that could overflow::

        >>> history = WeightHistory()
        >>> history.after_check(4, None, grads_bad=False, grad_norm=2.0, anomalous=False)
        >>> history.origin(5, seen_after=5, grads_bad=True, broken_before=None, may_overflow=lambda norm: False)
        ParamsOrigin(label=5, update_step=5, by_gradients=True, before_forward=False, since='in the optimizer step at step 5')
    """

    def __init__(self) -> None:
        self.last_check = LastCheck()
        self.broken_at: int | None = None
        self.last_finite_step = -1
        self.last_grad_norm = math.nan

    def wants_measure_before(self, step: int, measured_step: int, may_overflow: Callable[[float], bool]) -> bool:
        """Whether to flag the weights before ``step``'s forward: the previous update may have overflowed them."""
        last = self.last_check
        return not (measured_step == step or last.step != step - 1 or last.grads_bad or self.broken_at is not None
                    or not may_overflow(last.grad_norm))

    def origin(self, step: int, seen_after: int | None, grads_bad: bool, broken_before: object | None,
               may_overflow: Callable[[float], bool]) -> ParamsOrigin:
        """Which update made the parameters non-finite. ``seen_after``: the last update the scan saw (None: before
        this step's); ``broken_before``: the flag taken before this forward (None: not measured). A late scan blames
        this step's update unless the weights broke before its forward; an early one, an earlier update."""
        seen_after = seen_after if seen_after is not None else step - 1
        last = self.last_check
        if self.broken_at is not None and self.broken_at < step:
            return ParamsOrigin(step, None, False, True, f"since step {self.broken_at}")
        if seen_after >= step and broken_before is not None:
            if bool(broken_before):  # measured before this step's forward (only after a risky update)
                return ParamsOrigin(step - 1, step - 1, False, True, f"in the optimizer step at step {step - 1}")
            return ParamsOrigin(step, step, grads_bad, False, f"in the optimizer step at step {step}")
        if seen_after >= step:  # the weights after this step's update
            if grads_bad and not (last.step == step - 1 and may_overflow(last.grad_norm)):
                return ParamsOrigin(step, step, True, False, f"in the optimizer step at step {step}")
            if last.step == step - 1 and not last.grads_bad and may_overflow(last.grad_norm):
                return ParamsOrigin(step - 1, step - 1, False, True, f"in the optimizer step at step {step - 1}")
            if seen_after == step:
                return ParamsOrigin(step, step, grads_bad, False, f"in the optimizer step at step {step}")
            return ParamsOrigin(seen_after, None, False, False, f"between steps {step} and {seen_after}")
        previous = self.last_finite_step
        if previous == step - 1 and last.step == step - 1:
            return ParamsOrigin(step, step - 1, last.grads_bad, True, f"in the optimizer step at step {step - 1}")
        since = f"between steps {previous} and {step}" if previous >= 0 else f"before step {step}"
        return ParamsOrigin(step, None, False, True, since)

    def final_origin(self, step: int) -> ParamsOrigin:
        """The origin of weights found non-finite after the last update::

            >>> history = WeightHistory()
            >>> history.after_check(9, None, grads_bad=True, grad_norm=float("nan"), anomalous=True)
            >>> history.final_origin(9).by_gradients, history.final_origin(12).since
            (True, 'after step 9')
        """
        known = self.last_finite_step == step and self.last_check.step == step
        since = (f"in the optimizer step at step {step}" if known else
                 f"after step {self.last_finite_step}" if self.last_finite_step >= 0 else f"by step {step}")
        return ParamsOrigin(step, step if known else None, known and self.last_check.grads_bad, False, since)

    def after_check(self, step: int, origin: ParamsOrigin | None, grads_bad: bool, grad_norm: float,
                    anomalous: bool) -> None:
        """Remember a judged step (``origin`` None: its weights are finite)."""
        if origin is not None:
            self.broken_at = origin.update_step if origin.update_step is not None else step
        else:
            self.last_finite_step = step
            self.broken_at = None
        if not anomalous and math.isfinite(grad_norm):
            self.last_grad_norm = grad_norm
        self.last_check = LastCheck(step, grads_bad, grad_norm)
