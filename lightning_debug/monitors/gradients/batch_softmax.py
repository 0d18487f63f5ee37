"""``learning_stalled`` (``softmax_over_batch``): the loss normalises the model's output over the batch, not over
the classes, as in ``nll_loss(log_softmax(logits, dim=0), y)``.

It runs, and its loss falls, so no other rule sees it: from ``log N`` at the first step (``N`` rows, where a
classifier starts near ``log C``) to a floor it never passes. Each class column is then a distribution over the
rows, the ``n_c`` rows of class ``c`` share its mass, and the loss is at least the mean of ``log n_c``: ``log N``
less the entropy of the batch's labels, at least ``log(N / C)``. What names it is the gradient of the output: in every
column but one, each row's gradient is the same multiple of ``softmax(output, dim=0)``
(:func:`~lightning_debug.checks.output_gradient.batch_softmax_fit`), which no loss over the classes and no contrastive
loss computed from the output gives.

Judged with ``loss_at_chance``, on a 2-d output of ``N`` rows and ``C >= 2`` columns with ``N >= 2C`` (with fewer
rows a loss over two classes can fit by chance, and the floor is under ``log 2``): suspected when :data:`FIT` of
the rows have that form and the loss is not under the floor; the kind's policy confirms two judgements, the second
100 steps on. A judgement of any other form clears the run for good; rows all alike (a zero-initialised head) are
not judged. Not seen: an output of more than two dimensions, a softmax applied to it by a module::

    >>> finding, cleared = batch_softmax_finding(100, 0, "`head` (Linear)", "head", [32, 4], 2.11, 1.0)
    >>> finding.details["cause"], round(finding.details["floor"], 3), cleared
    ('softmax_over_batch', 2.079, False)
    >>> batch_softmax_finding(100, 0, "`head` (Linear)", "head", [32, 4], 0.02, 0.0)  # cross_entropy's gradient
    (None, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion

KEY = "softmax_over_batch"
FIT = 0.9
"""The share of the rows whose gradient must have the form of a softmax over the batch: all of them but what
rounding takes."""
BELOW = 0.03
"""How far under ``log(N / C)`` (a share of it) the loss may read and still be at the floor."""


def batch_softmax_finding(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                          fit: float) -> tuple[Finding | None, bool]:
    """This judgement's suspicion of ``softmax_over_batch`` (its finding, or None) and whether the run is cleared
    for good. ``fit``: the output gradient's :func:`~lightning_debug.checks.output_gradient.batch_softmax_fit`."""
    if len(shape) != 2 or shape[1] < 2:
        return None, True
    if not (math.isfinite(loss) and math.isfinite(fit)):
        return None, False
    rows, classes = shape
    if rows < 2 * classes:
        return None, False
    floor = math.log(rows / classes)
    if fit < FIT or loss < (1 - BELOW) * floor:
        return None, True
    above = (f", above log({rows} / {classes}) = {floor:.4g}, a floor it cannot pass: each class's probability is "
             "shared among the batch's rows of that class")
    return Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"The loss normalises the model's output {described} over the batch, not over its {classes} classes "
        f"(step {step}, since step {since}): the output's gradient has, in every row, the form of "
        f"`nll_loss(log_softmax(output, dim=0))`, a softmax down each column of {rows} rows, and the loss is "
        f"{loss:.4g}{above}. A `log_softmax` or `softmax` over `dim=0` is the usual cause: pass the raw logits to "
        "`F.cross_entropy(logits, labels)`, or normalise over the classes (`dim=-1`).",
        {"cause": KEY, "modules": [label], "since_step": since, "loss": loss, "floor": floor, "classes": classes,
         "rows": rows, "batch_softmax_fit": fit, "shape": list(shape)}), False


def batch_softmax_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                            fit: float) -> tuple[Suspicion | None, bool]:
    """:func:`batch_softmax_finding` as the suspicion the kind's policy holds (its ``variant``), and whether the run
    is cleared for good::

        >>> suspicion, _ = batch_softmax_suspicion(0, 0, "`head` (Linear)", "head", [32, 4], 3.47, 1.0)
        >>> suspicion.key, suspicion.variant, suspicion.finding.details["rows"]
        ('softmax_over_batch', 'softmax_over_batch', 32)
    """
    finding, cleared = batch_softmax_finding(step, since, described, label, shape, loss, fit)
    if finding is None:
        return None, cleared
    return Suspicion(Kind.LEARNING_STALLED, KEY, step, finding=finding, variant=KEY), cleared


__all__ = ["BELOW", "FIT", "KEY", "batch_softmax_finding", "batch_softmax_suspicion"]
