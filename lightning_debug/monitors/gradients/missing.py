"""``missing_grad``: trainable parameters that received no gradient at all.

Example::

    >>> verdict = judge_missing(0, ["head.weight", "head.bias"], 4, {})
    >>> verdict.finding.details["layers"], verdict.flagged
    (['head'], ['head.weight', 'head.bias'])
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.layout import Positions, input_to_output, module_of
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict, quoted

DDP_NOTE = ("Under DDP an unused parameter makes backward fail unless the strategy finds unused parameters "
            "(Trainer(strategy='ddp_find_unused_parameters_true')), which walks the autograd graph every step; "
            "removing the parameter or freezing it with requires_grad_(False) is cheaper.")


def judge_missing(step: int, missing: Sequence[str], trainable: int, positions: Positions) -> Verdict | None:
    """The ``missing_grad`` finding for the parameters ``missing`` (``.grad is None`` after the backward)."""
    if not missing:
        return None
    ordered = input_to_output(missing, positions)
    return Verdict(Finding(
        Kind.MISSING_GRAD, Severity.WARNING,
        f"{len(missing)} of {trainable} trainable parameters received no gradient at step {step}: "
        f"{quoted(ordered)}. A layer that is never used in the forward, or a branch cut off by detach(), "
        f"no_grad(), .data or .item(). Use it, remove it, or call requires_grad_(False). {DDP_NOTE}",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(missing),
         "layers": list(dict.fromkeys(module_of(n) or n for n in ordered))[:NAMES_IN_DETAILS],
         "ddp": "find_unused_parameters=True is required under DDP while these stay unused"}),
        list(missing))
