"""``learning_stalled``: every param group's learning rate is 0, or at most :data:`NEGLIGIBLE_LR` of its base, far from
the end of the run.

A schedule that reaches 0 early stops training with no NaN and no error, and so does one that decays without end
(``StepLR(step_size=30, gamma=0.1)`` written per epoch and registered per step is about 1e-6 of its base from step 180,
never 0; ``ReduceLROnPlateau(mode="max")`` on a loss halves it at every patience). A warm-up from 0 (one step at
0) is ruled out by the kind's policy (2 check steps in a row), a warm restart by the stall's length,
:func:`stall_span` (1% of the run: a cosine decay to 0 with warm restarts is under 1e-6 of its base for 0.06% of a
cycle), a decay to 0 at the end by judging only before :data:`END_SHARE` of
a run of known length, a group frozen on purpose by needing every group at 0, a run that fits its training data
(``ReduceLROnPlateau(mode="min")`` cutting the lr once the loss is 0) by a loss at most :data:`FITTED_SHARE` of its
first; a base learning rate of 0 is ``frozen_param``. Without a scheduler the base is the lr when training started,
so code that sets every lr to 0 mid-run is the same stall::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> verdicts = VerdictEngine()
    >>> groups = [{"params": [object()], "lr": 0.0, "initial_lr": 0.1}]
    >>> [judge_stalled(step, groups, verdicts, total_steps=1000, schedulers=["LambdaLR"]) is not None
    ...  for step in (100, 101, 110)]
    [False, False, True]
    >>> [judge_stalled(step, groups, VerdictEngine(), total_steps=60, schedulers=[]) for step in (55, 56, 57)]
    [None, None, None]
    >>> zeroed, no_scheduler = [{"params": [object()], "lr": 0.0}], VerdictEngine()
    >>> [judge_stalled(step, zeroed, no_scheduler, 1000, [], start_lrs=[0.05]) is not None for step in (100, 200)]
    [False, True]
    >>> decayed, steps = VerdictEngine(), [{"params": [object()], "lr": 5e-9, "initial_lr": 0.05}]
    >>> [judge_stalled(step, steps, decayed, 1000, ["StepLR"]) is not None for step in (300, 400)]
    [False, True]
    >>> low = [{"params": [object()], "lr": 5e-7, "initial_lr": 0.05}]  # 1e-5 of its base: still a learning rate
    >>> [judge_stalled(step, low, VerdictEngine(), 1000, ["StepLR"]) for step in (300, 400)]
    [None, None]
    >>> [judge_stalled(step, steps, VerdictEngine(), 1000, ["StepLR"], losses=(1e-5, 1.4)) for step in (300, 400)]
    [None, None]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.rules import CheckStep, Moment, rule
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.trainability import number_equals_zero
from lightning_debug.monitors.gradients.verdict import Verdict

END_SHARE = 0.9
"""Past this share of the run's steps a learning rate of 0 is a schedule ending, not a stall."""
NEGLIGIBLE_LR = 1e-6
"""A learning rate at most this share of its group's base is 0 in effect (an update of a millionth of a healthy one).
A cosine or linear decay to 0 is under it only in the last 0.1% of its steps, a warm-up from 0 on its first step."""
STALL_SHARE = 0.01
"""The share of a run's steps a learning rate at 0 in effect must last, from the first check step that saw it: a warm
restart's dip under :data:`NEGLIGIBLE_LR` lasts 0.06% of its cycle, so no cycle as long as the run reaches it."""
FITTED_SHARE = 1e-4
"""A loss at most this share of the run's first is a fitted training set: a learning rate cut to 0 then ends a run
that has nothing left to learn. ``ReduceLROnPlateau(mode="max")`` on an MSE loss stalls it at 1e-2 of its first."""
KEY = "lr_zero"


def fitted(loss: float, first_loss: float) -> bool:
    """Whether the loss fell to at most :data:`FITTED_SHARE` of the run's first, a positive loss::

        >>> fitted(1e-5, 1.4), fitted(0.0, 1.4), fitted(0.05, 12.5), fitted(-3.0, 2.0), fitted(float("nan"), 1.4)
        (True, True, False, False, False)
    """
    return 0 < first_loss and 0 <= loss <= FITTED_SHARE * first_loss


def stall_span(total_steps: int) -> int:
    """How many steps a learning rate at 0 in effect must last to be a stall::

        >>> stall_span(60), stall_span(400), stall_span(1_000_000)
        (1, 4, 10000)
    """
    return math.ceil(STALL_SHARE * total_steps)


def base_lr(group: Mapping[str, Any], index: int, start_lrs: Sequence[Any]) -> Any:
    """A group's base learning rate: its scheduler's ``initial_lr``, else its lr when training started::

        >>> base_lr({"lr": 0.0, "initial_lr": 0.1}, 0, [0.0]), base_lr({"lr": 0.0}, 0, [0.05])
        (0.1, 0.05)
        >>> base_lr({"lr": 0.2}, 1, [])
        0.2
    """
    if "initial_lr" in group:
        return group["initial_lr"]
    return start_lrs[index] if index < len(start_lrs) else group.get("lr")


def negligible(lr: Any, base: Any) -> bool:
    """Whether a learning rate is 0, or a plain number at most :data:`NEGLIGIBLE_LR` of its base above 0::

        >>> negligible(0.0, 0.1), negligible(1e-8, 0.1), negligible(1e-6, 0.1), negligible(1e-8, 0.0)
        (True, True, False, False)
    """
    if number_equals_zero(lr):
        return True
    numbers = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in (lr, base))
    return numbers and 0 < base and 0 <= lr <= NEGLIGIBLE_LR * base


def resting_slots(param_groups: Sequence[Mapping[str, Any]], params: Sequence[Any],
                  start_lrs: Sequence[Any] = ()) -> list[bool]:
    """For each of ``params``, whether its group's current learning rate is 0 or 0 in effect (:func:`negligible`;
    empty when none is): a step at such a rate leaves the weights as they were, which is the learning rate's doing
    (``learning_stalled`` judges it), not a frozen parameter's::

        >>> a, b, c = object(), object(), object()
        >>> groups = [{"params": [a], "lr": 0}, {"params": [b], "lr": 5e-9, "initial_lr": 0.05},
        ...           {"params": [c], "lr": 0.1}]
        >>> resting_slots(groups, [a, b, c]), resting_slots(groups[2:], [c])
        ([True, True, False], [])
    """
    resting = {id(p) for index, group in enumerate(param_groups)
               if negligible(group.get("lr"), base_lr(group, index, start_lrs)) for p in group.get("params", [])}
    return [id(p) in resting for p in params] if resting else []


def judge_stalled(step: int, param_groups: Sequence[Mapping[str, Any]], verdicts: VerdictEngine,
                  total_steps: int | None, schedulers: Sequence[str],
                  start_lrs: Sequence[Any] = (), losses: tuple[float, float] = (math.nan, math.nan)) -> Verdict | None:
    """The ``learning_stalled`` finding of check step ``step``, or None; ``start_lrs``: each group's lr when
    training started; ``losses``: the last loss read back and the run's first."""
    based = [(group, base_lr(group, index, start_lrs)) for index, group in enumerate(param_groups)
             if group.get("params")]
    groups = [group for group, _ in based]
    stalled = bool(groups) and all(negligible(group.get("lr"), base) for group, base in based)
    if stalled and all(number_equals_zero(base) for _, base in based):
        return None  # a base learning rate of 0 is frozen_param (lr_zero), said at fit start: not judged here
    far_from_end = total_steps is not None and step < END_SHARE * total_steps
    suspicions = ([Suspicion(Kind.LEARNING_STALLED, KEY, step, variant=KEY, lasting=stall_span(total_steps or 0))]
                  if stalled and far_from_end and not fitted(*losses) else [])
    confirmed = verdicts.observe(Kind.LEARNING_STALLED, step, suspicions, judged=[KEY])
    if not confirmed or total_steps is None:
        return None
    since = confirmed[0].first.step
    bases = sorted({float(base) for _, base in based if isinstance(base, (int, float))})
    started = f" (it started at {', '.join(f'{lr:g}' for lr in bases)})" if bases else ""
    by = f" by {', '.join(schedulers)}" if schedulers else " by the training code (no scheduler)"
    rates = sorted({float(group["lr"]) for group in groups if isinstance(group.get("lr"), (int, float))})
    level = ("0" if not any(rates) else
             f"{', '.join(f'{lr:.3g}' for lr in rates)}, at most {NEGLIGIBLE_LR:g} of its base and so 0 in effect")
    cause = ("a scheduler that reaches 0 early is the usual cause" if not any(rates) else
             "a schedule that decays without end is the usual cause (a step or exponential decay meant per epoch "
             "and registered per step: interval 'step' in Lightning's lr_scheduler config; or a ReduceLROnPlateau "
             "whose metric never improves in its mode, such as mode='max' on a loss, or that watches a per-batch loss "
             "whose noise rarely beats its best, with no min_lr)")
    return Verdict(Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"Training stopped learning at step {since}: the learning rate of every param group "
        f"({len(groups)}) is {level}{started}, set{by}, with {total_steps - step} of {total_steps} steps still to "
        f"go. The weights no longer change; {cause}: print scheduler.get_last_lr() around that step.",
        {"since_step": since, "param_groups": len(groups), "initial_lr": bases, "learning_rates": rates,
         "schedulers": list(schedulers), "total_steps": total_steps}),
        [f"param group {index}" for index in range(len(groups))], key=KEY)


@rule(Kind.LEARNING_STALLED, at=Moment.CHECK_STEP)
def stalled_at_check_step(facts: CheckStep) -> Verdict | None:
    """The registered rule: :func:`judge_stalled` on every gradient check step, before the optimizer step."""
    return judge_stalled(facts.step, facts.param_groups, facts.verdicts, facts.total_steps, facts.schedulers,
                         facts.start_lrs, (facts.loss, facts.first_loss))
