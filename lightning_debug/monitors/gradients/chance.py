"""``learning_stalled`` (``loss_at_chance``): a classifier whose predictions are no better than their own average
learns nothing from its inputs.

Labels shuffled against the inputs (a misaligned join, a shuffle applied to one column) leave nothing to learn: the
model learns how often each class comes and nothing else, so its cross-entropy sits at what one answer for every
sample costs (``log C``, a uniform guess over the ``C`` classes of its output, when the classes are balanced; less
when they are not) from the first step to the last while the weights move at a normal rate, so nothing is
non-finite, no gradient vanishes and no update is small. Where the gradient of the output has ``cross_entropy``'s
form in :data:`ROWS` rows or more and the step's loss is their cross-entropy (within :data:`ABOVE`: the loss
``cross_entropy`` computes, not a policy gradient's or a sum of several), the rows' own cost is compared with what
their average prediction costs on the same rows (:func:`~lightning_debug.checks.output_gradient.average_guess`),
whatever the balance of the classes; elsewhere (no such gradient, another loss, or a guess so cheap that the inputs
have almost nothing left to explain: under :data:`EXPLAINED` of ``log C``) the step's loss is compared with
``log C``. A model that learns anything from its inputs goes below the reference by more than :data:`BAND` and is
then cleared for good; a fine-tune that starts at chance and learns late leaves it before the hold ends.

Judged on the activation monitor's check steps (at most once every 100 optimizer steps): suspected while the measure
is within :data:`BAND` below the reference (or up to :data:`ABOVE` above the average guess: rows that spread their
answers at random pay a little more than their average); the kind's policy confirms four judgements in a row, 300
steps there, but not while a learning rate rises (:func:`warming_up`: a model at a warm-up's start has not learned
its labels' frequencies yet, let alone its inputs), nor, against the rows' average, before the model has trained on
:data:`SEEN` rows per class (:func:`seen_per_class`). An output of one value (a regression, a binary logit) is not
judged. The loss is the one the training step computed (under Lightning's gradient accumulation, what
``on_before_backward`` gets times ``accumulate_grad_batches``: ``RunContext.loss_divisor``).

Example::

    >>> finding, learned = chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 1.3871)
    >>> finding.details["cause"], round(finding.details["chance"], 4), learned
    ('loss_at_chance', 1.3863, False)
    >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 1.1)  # below chance: it learned something
    (None, True)
    >>> # half the labels one class of ten: one answer for all costs 1.79, and so do the rows
    >>> finding, _ = chance_finding(300, 0, "`head` (Linear)", "head", [32, 10], 1.80, 32, 1.80, 1.79)
    >>> round(finding.details["reference"], 2), finding.details["measure"]
    (1.79, 'rows_against_average')
    >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 10], 0.9, 32, 0.9, 1.79)  # it learns from its inputs
    (None, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.strenum import StrEnum
from lightning_debug.core.verdicts import Suspicion
from lightning_debug.monitors.gradients.weight_decay import decay_advice

KEY = "loss_at_chance"


class Measure(StrEnum):
    """What a judgement compared (``details.measure``)."""

    ROWS_AGAINST_AVERAGE = "rows_against_average"
    """The rows' own cross-entropy against what their average prediction costs."""
    LOSS_AGAINST_LOG_CLASSES = "loss_against_log_classes"
    """The step's loss against ``log C``."""


BAND = 0.03
"""How far below the reference (a share of it) the measure may be and still be chance: a batch's mean cross-entropy
of answers that ignore the inputs varies by less; a model that learned anything from them is further below."""
ABOVE = 0.25
"""How far above the average guess (a share of it) the rows may pay and still be chance: with labels that do not
belong to their inputs the answers follow last steps' noise and cost a few percent more than their average; a
quarter more is a model thrown off by something else (a diverging step), judged by the loss rules."""
EXPLAINED = 0.25
"""The share of ``log C`` that one answer for all must cost for the rows to be compared with it: under it (a batch
of nearly one class) nearly nothing is left for the inputs to explain, and the loss is compared with ``log C``."""
ROWS = 8
"""The rows of ``cross_entropy``'s form the comparison needs: one row is its own average, and a few are nearly so."""
SEEN = 50
"""The labelled rows per class a model must have trained on (``(step + 1)`` times the rows of a batch, over ``C``)
before rows no better than their average confirm: a model over tens of thousands of classes learns how often each
comes long before it learns them from its inputs (an embedding over 33,000 tokens at 512 a step had seen each 5 times
by step 300 and was still learning its first maps; a recommender's popularity baseline), while 10 classes at 32 a
step are seen 320 times by step 100."""


def chance_finding(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                   rows: float = 0, rows_loss: float = math.nan,
                   average_loss: float = math.nan, decay: float = 0.0) -> tuple[Finding | None, bool]:
    """This judgement's suspicion of ``loss_at_chance`` (its finding, or None), and whether the measure proves the
    model learned something (below the reference: the run is cleared for good). ``since``: the step the hold began;
    ``rows``, ``rows_loss`` and ``average_loss``: how many rows of the output's gradient had ``cross_entropy``'s form,
    their own cross-entropy and their average prediction's
    (:data:`~lightning_debug.checks.output_gradient.AVERAGE_GUESS`); ``decay``: the share of a weight weight decay
    takes per step (:func:`~lightning_debug.monitors.gradients.weight_decay.decay_per_step`), named first from
    :data:`~lightning_debug.monitors.gradients.weight_decay.STRONG_DECAY` on. An output of one dimension has no classes
    to guess among (a regression's (N,), a loss per sample)::

        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32], math.log(32))
        (None, False)
        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], math.log(4))[0].details["classes"]
        4
        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 0.05, 32, 0.05, 0.05)  # one class: log C rules
        (None, True)
        >>> # a policy gradient's loss is not its rows' cross-entropy: the loss against log C, far from it
        >>> chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], 3.0, 32, 1.2, 1.2)
        (None, False)
        >>> decayed, _ = chance_finding(300, 0, "`head` (Linear)", "head", [32, 4], math.log(4), decay=0.25)
        >>> decayed.details["decay_per_step"], "Weight decay takes 0.25 of every weight each step" in decayed.message
        (0.25, True)
    """
    classes = shape[-1] if len(shape) >= 2 else 0
    if classes < 2:
        return None, False
    chance = math.log(classes)
    compared = (rows >= ROWS and math.isfinite(rows_loss) and math.isfinite(average_loss)
                and average_loss >= EXPLAINED * chance and abs(loss - rows_loss) <= ABOVE * rows_loss)
    value, reference, above = (rows_loss, average_loss, ABOVE) if compared else (loss, chance, BAND)
    if not math.isfinite(value):
        return None, False
    if value < (1 - BAND) * reference:
        return None, True
    if value > (1 + above) * reference:
        return None, False
    balanced = reference >= (1 - BAND) * chance
    level = (f"the cross-entropy of a uniform guess over the {classes} classes of the model's output {described} "
             f"(log {classes} = {chance:.4g})" if balanced else
             f"what one answer for every sample costs (its rows' average prediction: {reference:.4g}, under log "
             f"{classes} = {chance:.4g} because the {classes} classes of the model's output {described} are "
             "unbalanced)")
    learned = "learns nothing from its labels" if balanced else "learns how often each class comes and nothing else"
    decayed = f"{advice} Otherwise check" if (advice := decay_advice(decay)) else "Check"
    return Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"The loss has stayed at {loss:.4g} since step {since} (step {step}), {level}: the model {learned}. {decayed} "
        "that the labels belong to their inputs (a shuffle or a sort applied to one of them, a misaligned join, the "
        "wrong label column) and that the task has signal; if they do, the learning rate may be far too small for "
        "the model to show it has learned anything (a model that learns from its inputs goes below it), or the task "
        "is one learnt only after a long plateau (parity, copying).",
        {"cause": KEY, "modules": [label], "since_step": since, "loss": loss, "chance": chance, "classes": classes,
         "shape": list(shape), "reference": reference, "decay_per_step": decay,
         "measure": (Measure.ROWS_AGAINST_AVERAGE if compared else Measure.LOSS_AGAINST_LOG_CLASSES).value}), False


def plain_learning_rates(param_groups: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Each param group's learning rate as a number, None for a tensor one (reading it would sync)::

        >>> plain_learning_rates([{"lr": 0.1}, {"lr": torch.tensor(0.1)}])
        [0.1, None]
    """
    return [float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
            for lr in (group.get("lr") for group in param_groups)]


def warming_up(rates: Sequence[float | None], before: Sequence[float | None] | None) -> bool:
    """Whether a group's learning rate rose since the judgement ``before`` (a warm-up, the first part of a one-cycle
    schedule, a warm restart): a model learns little at a learning rate on its way up, so a suspicion is held but not
    confirmed until it stops rising::

        >>> warming_up([3e-4], [2e-4]), warming_up([1e-3], [1e-3]), warming_up([5e-4], [1e-3])
        (True, False, False)
        >>> warming_up([1e-3], None), warming_up([None], [1e-3])
        (False, False)
    """
    return before is not None and len(before) == len(rates) and any(
        now is not None and then is not None and now > then for now, then in zip(rates, before))


def seen_per_class(step: int, shape: Sequence[int]) -> float:
    """The labelled rows per class trained on by ``step``, from the output's shape (its rows, over its last dimension),
    as if every batch had this one's rows (under gradient accumulation, fewer than were: the judgement comes later)::

        >>> seen_per_class(99, [32, 10]), seen_per_class(299, [32, 16, 33_000]) < SEEN
        (320.0, True)
    """
    return (step + 1) * math.prod(shape[:-1]) / max(1, shape[-1]) if len(shape) >= 2 else 0.0


def chance_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                     rows: float = 0, rows_loss: float = math.nan, average_loss: float = math.nan,
                     rates: Sequence[float | None] = (),
                     rates_before: Sequence[float | None] | None = None,
                     decay: float = 0.0) -> tuple[Suspicion | None, bool]:
    """:func:`chance_finding` as the suspicion the kind's policy holds (its ``variant``), and whether the run is
    cleared for good. ``rates``: the param groups' learning rates now (:func:`plain_learning_rates`), kept in the
    hold; ``rates_before``: those of the judgement before, while held; the suspicion does not confirm while they rise
    (:func:`warming_up`), nor, measured against the rows' average, before the model has trained on :data:`SEEN` rows
    per class (:func:`seen_per_class`).

    Example::

        >>> suspicion, _ = chance_suspicion(200, 0, "`head` (Linear)", "head", [32, 10], 2.30, rates=[1e-3])
        >>> suspicion.key, suspicion.variant, suspicion.finding.details["classes"], suspicion.confirms
        ('loss_at_chance', 'loss_at_chance', 10, True)
        >>> rising, _ = chance_suspicion(200, 0, "`head` (Linear)", "head", [32, 10], 2.30, rates=[4e-4],
        ...                              rates_before=[2e-4])
        >>> rising.confirms
        False
        >>> early, _ = chance_suspicion(300, 0, "`lm_head` (Linear)", "lm_head", [32, 16, 33_000], 7.3, 64, 7.3, 7.25)
        >>> early.finding.details["measure"], early.confirms
        ('rows_against_average', False)
    """
    finding, learned = chance_finding(step, since, described, label, shape, loss, rows, rows_loss, average_loss, decay)
    if finding is None:
        return None, learned
    early = finding.details["measure"] == Measure.ROWS_AGAINST_AVERAGE and seen_per_class(step, shape) < SEEN
    return Suspicion(Kind.LEARNING_STALLED, KEY, step, finding=finding, variant=KEY,
                     measured={"learning_rates": list(rates)},
                     confirms=not (early or warming_up(rates, rates_before))), learned


__all__ = ["ABOVE", "BAND", "EXPLAINED", "KEY", "ROWS", "SEEN", "Measure", "chance_finding", "chance_suspicion",
           "plain_learning_rates", "seen_per_class", "warming_up"]
