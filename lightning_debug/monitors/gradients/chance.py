"""``learning_stalled`` (``loss_at_chance``): a classifier whose loss stays at ``log C``, the cross-entropy of a
uniform guess over the ``C`` classes of its output, learns nothing from its labels.

Labels shuffled against the inputs (a misaligned join, a shuffle applied to one column) leave nothing to learn: the
cross-entropy sits at ``log C`` from the first step to the last while the weights move at a normal rate, so nothing
is non-finite, no gradient vanishes and no update is small. The level tells it from a healthy run: a model that
learns anything at all (the frequencies of unbalanced classes, the easy samples) goes below ``log C``, and is then
cleared for good; a fine-tune that starts at chance and learns late leaves it before the hold ends.

Judged on the activation monitor's check steps (at most once every 100 optimizer steps), from the
width of the model's output (its last module call) and the step's loss: suspected while the loss is within
:data:`BAND` of ``log C``; the kind's policy confirms four judgements in a row, 300 steps at chance. An output of
one value (a regression, a binary logit) is not judged. The loss is the one the training step computed (under
Lightning's gradient accumulation, what ``on_before_backward`` gets times ``accumulate_grad_batches``:
``RunContext.loss_divisor``).

Example::

    >>> finding, learned = chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 1.3871)
    >>> finding.details["cause"], round(finding.details["chance"], 4), learned
    ('loss_at_chance', 1.3863, False)
    >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 1.1)  # below chance: it learned something
    (None, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion

KEY = "loss_at_chance"
BAND = 0.03
"""How far from ``log C`` (a share of it) the loss may be and still be chance: a batch's mean cross-entropy of near
uniform rows varies by less; a model that learned anything is further below."""


def chance_finding(step: int, since: int, described: str, label: str, shape: Sequence[int],
                   loss: float) -> tuple[Finding | None, bool]:
    """This judgement's suspicion of ``loss_at_chance`` (its finding, or None), and whether the loss proves the model
    learned something (below chance: the run is cleared for good). ``since``: the step the hold began. An output of
    one dimension has no classes to guess among (a regression's (N,), a loss per sample)::

        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32], math.log(32))
        (None, False)
        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], math.log(4))[0].details["classes"]
        4
    """
    classes = shape[-1] if len(shape) >= 2 else 0
    if classes < 2 or not math.isfinite(loss):
        return None, False
    chance = math.log(classes)
    if loss < (1 - BAND) * chance:
        return None, True
    if loss > (1 + BAND) * chance:
        return None, False
    return Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"The loss has stayed at {loss:.4g} since step {since} (step {step}), the cross-entropy of a uniform guess "
        f"over the {classes} classes of the model's output {described} (log {classes} = {chance:.4g}): the model "
        "learns nothing from its labels. Check that the labels belong to their inputs "
        "(a shuffle or a sort applied to one of them, a misaligned join, the wrong label column) and that the task "
        "has signal; if they do, the learning rate may be far too small for the model to show it has learned "
        "anything (a model that learns anything goes below log C).",
        {"cause": KEY, "modules": [label], "since_step": since, "loss": loss, "chance": chance, "classes": classes,
         "shape": list(shape)}), False


def chance_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int],
                     loss: float) -> tuple[Suspicion | None, bool]:
    """:func:`chance_finding` as the suspicion the kind's policy holds (its ``variant``), and whether the run is
    cleared for good.

    Example::

        >>> suspicion, _ = chance_suspicion(200, 0, "`head` (Linear)", "head", [32, 10], 2.30)
        >>> suspicion.key, suspicion.variant, suspicion.finding.details["classes"]
        ('loss_at_chance', 'loss_at_chance', 10)
    """
    finding, learned = chance_finding(step, since, described, label, shape, loss)
    if finding is None:
        return None, learned
    return Suspicion(Kind.LEARNING_STALLED, KEY, step, finding=finding, variant=KEY), learned


__all__ = ["BAND", "KEY", "chance_finding", "chance_suspicion"]
