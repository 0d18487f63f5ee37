"""``learning_stalled`` (``probabilities_into_log_softmax``, ``probabilities_into_sigmoid``): the model outputs
probabilities and the loss applies a softmax, or a sigmoid, to them again.

``F.cross_entropy`` fed rows that are already probabilities can never go below ``log(1 + (C - 1) / e)`` (the
loss of a one-hot row), its gradients shrink as the outputs sharpen, and nothing is NaN: no other rule sees it.
Judged on the output's ``simplex_stats`` the activation monitor reads back (docs/gradients.md gives the
conditions). The bounds are narrow on purpose: ``nll_loss(log(p))`` at about half its samples right crosses
``logit_loss`` often, so only confident rows are judged, in a one-sided band; on 96 such healthy runs 0.02% of
steps were suspect and never two in a row, where a wider band named 13 of them. Where the output's gradient was read
(:func:`~lightning_debug.checks.output_gradient.softmax_twice`) and is what ``cross_entropy`` of the rows taken as logits
gives, which those losses on probabilities never give, and the loss is what that gradient predicts, the rows are
judged at any confidence, with the label smoothing and the factor the loss has (:func:`scaled_reading`):
``CrossEntropyLoss(label_smoothing=0.1)`` after an ``nn.Softmax`` sits above ``logit_loss`` by about the smoothing's
``e (C - 1) / C``, outside the band, and ``loss * 0.5``, ``loss / 4`` or ``reduction="sum"`` move the loss from the
floor by their factor. Otherwise a loss below the floor proves the loss is not cross-entropy on these probabilities
and clears the run for good. Not read that way: class weights with label smoothing, a loss of more than
:data:`~lightning_debug.checks.output_gradient.SOFTMAX_ELEMENTS` outputs, a gradient scaled by float16's ``GradScaler``
(then only the band at a factor of 1 judges). A sigmoid's output fed to ``cross_entropy`` as logits has the same floor:
values in [0, 1] that no affine map made, whose rows do not sum to 1, are judged on the gradient's reading alone::

    >>> values = [0.0, 1.0, 1e-7, 0.7437]  # one-hot rows of 4 classes, and cross_entropy on them
    >>> finding, below = probability_finding(300, 200, "`out` (Softmax)", "out", [32, 4], values, 0.7437, 1e-3)
    >>> finding.details["cause"], round(finding.details["floor"], 4), below
    ('probabilities_into_log_softmax', 0.7437, False)
    >>> probability_finding(300, 300, "`out` (Softmax)", "out", [32, 4], values, 0.02, 1e-3)  # nll_loss(log(p))
    (None, True)

A sigmoid's output fed to ``binary_cross_entropy_with_logits`` (``BCEWithLogitsLoss`` after an ``nn.Sigmoid``) is
the same mistake for labels of 0 and 1: ``sigmoid(p)`` of a ``p`` in [0, 1] lies in [0.5, 0.73], so a label of 0
costs at least ``log 2`` and one of 1 at least ``log(1 + 1/e)``. The loss does not tell it; the output's gradient
does (:func:`~lightning_debug.checks.output_gradient.sigmoid_twice`, read by the activation monitor's hook on its judged
steps): every value's is ``(sigmoid(p) - t) / n``, times ``pos_weight`` (one per column) where ``t`` is 1. Held two
judgements, the second 100 steps on; a judgement of another form (``binary_cross_entropy``, logits out of [0, 1],
soft labels) clears the run for good::

    >>> finding, cleared = sigmoid_finding(200, 100, "`out` (Sigmoid)", "out", [32, 4], 0.70, 1.0, 0.25)
    >>> finding.details["cause"], round(finding.details["floor"], 4), cleared
    ('probabilities_into_sigmoid', 0.5982, False)
    >>> sigmoid_finding(200, 200, "`out` (Sigmoid)", "out", [32, 4], 0.05, 0.1, 0.25)  # binary_cross_entropy
    (None, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_debug.checks.output_gradient import SMOOTHING_MAX, SOFTMAX_TWICE
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion

KEY = "probabilities_into_log_softmax"
SIGMOID_KEY = "probabilities_into_sigmoid"
SIGMOID_FIT = 0.9
"""The share of the output's values whose gradient must have the form of a sigmoid applied again: all of them but
what rounding takes."""
BAND = 0.05
"""How far above ``logit_loss`` the loss may be, as a share of ``log C`` minus the floor (0.032 for 4 classes)."""
BELOW = 0.01
"""How far under ``logit_loss`` the loss may be (rounding, a large output read in its first rows), the same way."""
CONFIDENT_SHARE = 0.35
"""Rows whose ``logit_loss`` is more than this share of the way from the floor up to ``log C`` are not judged: near
uniform every loss reads ``log C``, and half-confident rows are where ``nll_loss(log(p))`` crosses it."""
JUDGED_EVERY = 100
"""Optimizer steps at least between two judgements (the hold of two means the condition lasted this long)."""
FIT_SHARE = 0.9
"""The share of the output's rows whose gradient ``cross_entropy`` of the rows taken as logits must fit for the loss to
be read as that, at any confidence and any factor, with or without label smoothing."""
MISFIT = 0.01
"""How far the loss that fit predicts may be from the loss given, as a share of it (rounding)."""
SMOOTHING_SLACK = 0.01
"""A label smoothing read below this is none."""
SCALE_SLACK = 0.01
"""A factor on the loss within this of 1 is none."""


def floor_of(classes: int) -> float:
    """The smallest value ``cross_entropy`` reaches on rows that are probabilities: a one-hot row's::

        >>> round(floor_of(4), 4), round(floor_of(2), 4)
        (0.7437, 0.3133)
    """
    return math.log(1 + (classes - 1) / math.e)


def simplex_tolerance(dtype: torch.dtype) -> float:
    """How far a row's sum may be from 1 (and a value out of [0, 1]) in ``dtype`` and still be a softmax's::

        >>> simplex_tolerance(torch.float32), round(simplex_tolerance(torch.bfloat16), 4)
        (0.001, 0.0312)
    """
    return max(1e-3, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3


def smoothing_of(loss: float, gradient: Sequence[float], tolerance: float) -> float:
    """The label smoothing ``e`` for which the loss is ``cross_entropy(rows, labels, label_smoothing=e)`` of the
    output's rows taken as logits, from the output gradient's
    :data:`~lightning_debug.checks.output_gradient.SOFTMAX_TWICE` (``softmax_form``, ``label_loss``, ``uniform_loss``):
    0 without smoothing; NaN when the gradient does not have that loss's form on :data:`FIT_SHARE` of the rows, the
    rows are too near uniform to tell, or ``e`` is not one a model trains with (below 0, above
    :data:`~lightning_debug.checks.output_gradient.SMOOTHING_MAX`). Read where :func:`scaled_reading` is not (class
    weights with smoothing), at a factor of 1::

        >>> round(smoothing_of(0.825, [1.0, 0.75, 1.5], 1e-3), 4), smoothing_of(0.75, [1.0, 0.75, 1.5], 1e-3)
        (0.1, 0.0)
        >>> smoothing_of(0.0001, [1.0, 0.7502, 1.4909], 1e-3)  # mse_loss against one-hot targets: the same form
        nan
    """
    share, one_hot, uniform = (float(value) for value in (list(gradient) + [math.nan] * 3)[:3])
    gap = uniform - one_hot
    if not (share >= FIT_SHARE and math.isfinite(loss) and gap > 10 * tolerance):
        return math.nan
    smoothing = (loss - one_hot) / gap
    return max(smoothing, 0.0) if -SMOOTHING_SLACK <= smoothing <= SMOOTHING_MAX else math.nan


def scaled_reading(loss: float, gradient: Sequence[float]) -> tuple[float, float] | None:
    """The label smoothing ``e`` and the factor ``c`` for which the loss is ``c * cross_entropy(rows, labels,
    label_smoothing=e)`` of the output's rows taken as logits, read from the output gradient's
    :data:`~lightning_debug.checks.output_gradient.SCALED_CROSS_ENTROPY` (``softmax_fit``, ``softmax_misfit``,
    ``label_smoothing``, ``row_loss``); ``loss``: the loss as the step computed it (so that dividing by
    ``accumulate_grad_batches`` is not a factor). None where the gradient does not fit on :data:`FIT_SHARE` of the
    rows or the loss it predicts is not the loss::

        >>> scaled_reading(0.4125, [1.0, 1e-7, 0.1, 0.825]), scaled_reading(0.75, [1.0, 1e-7, 0.0, 0.75])
        ((0.1, 0.5), (0.0, 1.0))
        >>> scaled_reading(0.0001, [0.0, 2.7, 0.0, 0.7502])  # mse_loss against one-hot targets
    """
    fit, misfit, smoothing, row_loss = (float(value) for value in (list(gradient) + [math.nan] * 4)[:4])
    if not (fit >= FIT_SHARE and misfit <= MISFIT and row_loss > 0 and math.isfinite(loss) and loss > 0):
        return None
    return (smoothing if smoothing > SMOOTHING_SLACK else 0.0), loss / row_loss


def probability_finding(step: int, since: int, described: str, label: str, shape: Sequence[int],
                        values: Sequence[float], loss: float, tolerance: float,
                        gradient: Sequence[float] = (), logits: bool = True) -> tuple[Finding | None, bool]:
    """This check step's suspicion (its finding, or None), and whether the loss proves it is not the case for good
    (below the floor). ``values``: ``SIMPLEX`` of the model's output; ``gradient``: its gradient's
    ``SOFTMAX_TWICE`` and ``SCALED_CROSS_ENTROPY`` where it was read (:func:`smoothing_of`, :func:`scaled_reading`);
    ``since``: the step the hold began; ``logits``: whether an affine map may have made the output (False: no
    affine map did, so values in [0, 1] are a sigmoid's or a clamp's, and rows that do not sum to 1 are judged on the
    gradient's reading alone: ``cross_entropy(torch.sigmoid(z), y)`` has the same floor)::

        >>> values = [0.0, 1.0, 1e-7, 0.7441]
        >>> finding, _ = probability_finding(300, 200, "`out` (Softmax)", "out", [32, 4], values, 0.825, 1e-3,
        ...                                  [math.nan] * 3 + [1.0, 1e-7, 0.1, 0.825])
        >>> round(finding.details["label_smoothing"], 4), round(finding.details["floor"], 4)
        (0.1, 0.8187)
        >>> finding, below = probability_finding(300, 200, "`out` (Softmax)", "out", [32, 4], values, 0.372, 1e-3,
        ...                                      [math.nan] * 3 + [1.0, 1e-7, 0.0, 0.7441])  # loss * 0.5
        >>> round(finding.details["loss_scale"], 3), round(finding.details["floor"], 4), below
        (0.5, 0.3718, False)
        >>> finding, _ = probability_finding(200, 100, "`out`", "out", [32, 4], [1e-4, 0.999, 0.16, 0.765], 0.765,
        ...                                  1e-3, [math.nan] * 3 + [1.0, 0.0, 0.0, 0.765], logits=False)  # sigmoid
        >>> finding.details["summing_to_1"], round(finding.details["floor"], 4)
        (False, 0.7437)
    """
    classes = shape[-1] if shape else 0
    low, high, row_error, logit_loss = (float(value) for value in values)
    if classes < 2 or not all(math.isfinite(value) for value in (low, high, row_error, logit_loss, loss)):
        return None, False
    simplex = row_error <= tolerance
    if not (low >= -tolerance and high <= 1 + tolerance and (simplex or not logits)):
        return None, False
    floor, uniform = floor_of(classes), math.log(classes)
    span = uniform - floor
    read = list(gradient)
    reading = scaled_reading(loss, read[len(SOFTMAX_TWICE):])
    if reading is None and math.isfinite(smoothing := smoothing_of(loss, read[:len(SOFTMAX_TWICE)], tolerance)):
        reading = smoothing, 1.0
    if reading is None:
        if not simplex:
            return None, False
        if loss < floor - tolerance:
            return None, True
        if logit_loss > floor + CONFIDENT_SHARE * span or not -BELOW * span <= loss - logit_loss <= BAND * span:
            return None, False
    smoothing, scale = reading if reading is not None else (math.nan, 1.0)
    smoothed = math.isfinite(smoothing) and smoothing > 0
    scaled = abs(scale - 1) > SCALE_SLACK
    if smoothed:
        floor += smoothing * (classes - 1) / classes
    bound = (f"about {floor:.4g} (log(1 + ({classes} - 1)/e) plus the smoothing's {smoothing:.2g} x {classes - 1}/"
             f"{classes})" if smoothed else f"log(1 + ({classes} - 1)/e) = {floor:.4g}")
    factor = f"{scale:.3g} times " if scaled else ""
    what = (f"probabilities (every value in [0, 1], each of its rows of {classes} summing to 1)" if simplex else
            "bounded to [0, 1] (every value in it, and no affine map made them: a sigmoid's or a clamp's output, not "
            "logits)")
    advice = ("cross_entropy applies log_softmax itself: drop the softmax from the model (apply it at inference "
              "only), or keep it and train with nll_loss(torch.log(p)) (better: log_softmax, then nll_loss)."
              if simplex else "cross_entropy wants unbounded logits: drop the sigmoid (or clamp) before it; for "
              "labels that are not exclusive, train with binary_cross_entropy_with_logits on the logits.")
    return Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"The model's output {described} is {what} and the loss ({loss:.4g} at step {step}, since step {since}) is "
        f"{factor}what cross_entropy gives when it takes them as logits"
        f"{f' (with label_smoothing={smoothing:.2g})' if smoothed else ''}: it "
        f"can never go below {f'{scale:.3g} x ' if scaled else ''}{bound}, and its gradients shrink as the outputs "
        f"sharpen, so training stalls short of what the model can learn. {advice}",
        {"cause": KEY, "modules": [label], "since_step": since, "loss": loss, "floor": scale * floor,
         "summing_to_1": simplex,
         "classes": classes, "logit_loss": logit_loss, "shape": list(shape),
         **({"label_smoothing": smoothing} if math.isfinite(smoothing) else {}),
         **({"loss_scale": scale} if scaled else {})}), False


def probability_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int],
                          values: Sequence[float], loss: float, tolerance: float,
                          gradient: Sequence[float] = (), logits: bool = True) -> tuple[Suspicion | None, bool]:
    """:func:`probability_finding` as the suspicion the kind's policy holds (its ``variant``: two check steps in a
    row), and whether the run is cleared for good::

        >>> suspicion, _ = probability_suspicion(200, 100, "`out` (Softmax)", "out", [32, 4], [0, 1, 0, 0.75], 0.75,
        ...                                      1e-3)
        >>> suspicion.key, suspicion.variant, suspicion.finding.details["since_step"]
        ('probabilities_into_log_softmax', 'probabilities_into_log_softmax', 100)
    """
    finding, below = probability_finding(step, since, described, label, shape, values, loss, tolerance, gradient,
                                         logits)
    if finding is None:
        return None, below
    return Suspicion(Kind.LEARNING_STALLED, KEY, step, finding=finding, variant=KEY), below


def sigmoid_finding(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                    fit: float, positives: float, weight: float = 1.0) -> tuple[Finding | None, bool]:
    """This judgement's suspicion of ``probabilities_into_sigmoid`` (its finding, or None) and whether the run is
    cleared for good. ``fit``, ``positives``, ``weight``: the output gradient's
    :func:`~lightning_debug.checks.output_gradient.sigmoid_twice` (``weight``: the labels at 1's, ``pos_weight``)."""
    if not (math.isfinite(fit) and math.isfinite(positives)):
        return None, False
    if fit < SIGMOID_FIT:
        return None, True
    weight = weight if math.isfinite(weight) else 1.0
    floor = positives * weight * math.log1p(math.exp(-1.0)) + (1 - positives) * math.log(2.0)
    weighted = abs(weight - 1) > 1e-3
    return Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"The model's output {described} is probabilities (every value in [0, 1]) and the loss applies a sigmoid to "
        f"them again (step {step}, since step {since}; loss {loss:.4g}): the gradient of each value is "
        f"(sigmoid(p) - label) times one constant{' (and pos_weight at the labels at 1)' if weighted else ''}, what "
        "binary_cross_entropy_with_logits gives. The sigmoid of a "
        f"value in [0, 1] lies between 0.5 and 0.73, so the model can never say no with confidence, the loss "
        f"cannot go below {floor:.3g} per value (labels at 1: {positives:.0%}"
        f"{f', weighted {weight:.3g}x by pos_weight' if weighted else ''}), and training stalls. "
        "BCEWithLogitsLoss applies the sigmoid itself: drop the sigmoid from the model (apply it at inference "
        "only), or keep it and train with binary_cross_entropy (BCELoss).",
        {"cause": SIGMOID_KEY, "modules": [label], "since_step": since, "loss": loss, "floor": floor,
         "sigmoid_fit": fit, "positives": positives, "positive_weight": weight, "shape": list(shape)}), False


def sigmoid_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                      fit: float, positives: float, weight: float = 1.0) -> tuple[Suspicion | None, bool]:
    """:func:`sigmoid_finding` as the suspicion the kind's policy holds (its ``variant``), and whether the run is
    cleared for good::

        >>> suspicion, _ = sigmoid_suspicion(0, 0, "`out` (Sigmoid)", "out", [32, 4], 0.84, 1.0, 0.25)
        >>> suspicion.key, suspicion.variant
        ('probabilities_into_sigmoid', 'probabilities_into_sigmoid')
    """
    finding, cleared = sigmoid_finding(step, since, described, label, shape, loss, fit, positives, weight)
    if finding is None:
        return None, cleared
    return Suspicion(Kind.LEARNING_STALLED, SIGMOID_KEY, step, finding=finding, variant=SIGMOID_KEY), cleared


__all__ = ["JUDGED_EVERY", "KEY", "SIGMOID_KEY", "floor_of", "probability_finding", "probability_suspicion",
           "scaled_reading", "sigmoid_finding", "sigmoid_suspicion", "simplex_tolerance",
           "smoothing_of"]
