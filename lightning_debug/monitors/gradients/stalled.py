"""``learning_stalled``: every param group's learning rate is 0 far from the end of the run.

A scheduler that reaches 0 early (a ``LambdaLR`` whose factor becomes 0 after some step, a step
schedule with ``gamma=0``, a decay written for fewer steps than the run takes) stops training
without a NaN or an error: the loss goes flat and nothing else changes. The rule reads the learning
rates the optimizer is about to use on a check step (plain numbers on the host, no device work).

What could make it fire on a healthy model, and how it is ruled out: a warm-up that starts at 0 is 0
for one step, and the rule needs 3 check steps in a row; a schedule that decays to 0 at the end of
the run (cosine, linear) is 0 only in its last steps, and the rule judges only before 90% of the
run's steps, which it needs to know (``max_steps`` or Lightning's estimate; with no known end it says
nothing); a param group frozen on purpose with lr 0 beside groups that learn is not a stall (every
group must be at 0), and a base learning rate of 0 from the start is ``frozen_param`` (``lr_zero``).

Example::

    >>> history = StallHistory()
    >>> groups = [{"params": [object()], "lr": 0.0, "initial_lr": 0.1}]
    >>> [judge_stalled(step, groups, history, total_steps=60, schedulers=["LambdaLR"]) is not None
    ...  for step in (10, 11, 12)]
    [False, False, True]
    >>> judge_stalled(57, groups, StallHistory(checks=5, since=10), total_steps=60, schedulers=[]) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.trainability import number_equals_zero
from lightning_debug.monitors.gradients.verdict import Verdict

STALL_CHECKS = 3
"""Check steps in a row with every learning rate at 0 before the rule speaks."""
END_SHARE = 0.9
"""Past this share of the run's steps a learning rate of 0 is a schedule ending, not a stall."""


@dataclass
class StallHistory:
    """Since which check step every learning rate has been 0, and on how many check steps in a row."""

    since: int | None = None
    checks: int = 0


def judge_stalled(step: int, param_groups: Sequence[Mapping[str, Any]], history: StallHistory,
                  total_steps: int | None, schedulers: Sequence[str]) -> Verdict | None:
    """The ``learning_stalled`` finding of check step ``step``, or None (see the module's docstring)."""
    groups = [group for group in param_groups if group.get("params")]
    if not groups or not all(number_equals_zero(group.get("lr")) for group in groups):
        history.since, history.checks = None, 0
        return None
    if all(number_equals_zero(group.get("initial_lr", group.get("lr"))) for group in groups):
        return None  # a base learning rate of 0 is frozen_param (lr_zero), said at fit start
    if history.since is None:
        history.since = step
    history.checks += 1
    if history.checks < STALL_CHECKS or total_steps is None or step >= END_SHARE * total_steps:
        return None
    bases = sorted({float(group["initial_lr"]) for group in groups if isinstance(group.get("initial_lr"), (int, float))})
    started = f" (it started at {', '.join(f'{lr:g}' for lr in bases)})" if bases else ""
    by = f" by {', '.join(schedulers)}" if schedulers else ""
    return Verdict(Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"Training stopped learning at step {history.since}: the learning rate of every param group "
        f"({len(groups)}) is 0{started}, set{by}, with {total_steps - step} of {total_steps} steps still to go. "
        "The weights no longer change; a scheduler that reaches 0 early is the usual cause: print "
        "scheduler.get_last_lr() around that step.",
        {"since_step": history.since, "param_groups": len(groups), "initial_lr": bases,
         "schedulers": list(schedulers), "total_steps": total_steps}),
        [f"param group {index}" for index in range(len(groups))], key="lr_zero")
