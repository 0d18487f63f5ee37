"""``single_class_batches``: the batches hold one class each, another at the next judgement: the training data is
sorted by label and the loader does not shuffle it.

Nothing else sees it: the model learns the class in front of it and forgets the others, so the training loss is low
and nothing is non-finite; only a validation run shows a model that answers one class. The labels are read from the
gradient of the model's output (:func:`~lightning_debug.checks.output_gradient.batch_labels`, by the activation monitor's
hook on its judged steps): ``cross_entropy`` gives each row ``softmax(z) - onehot(label)``, whose one value below 0
is at the label. Suspected when at least :data:`FORM` of the rows of a batch of :data:`MIN_ROWS` or more have that
form and their labels run in order down the batch in runs of :data:`MIN_RUN` rows or more (one label, or the end of
one class and the start of the next), held with the first and last label (``Suspicion.measured["labels"]``); the
kind's policy confirms two judgements in a row, so a second such batch, 100 steps on, of other labels. A batch of
the same labels again drops the hold (heavily unbalanced data draws batches of its majority class alone); labels out
of order (shuffled data) or a gradient of another form clear the run for good. Not seen: unshuffled data whose epoch
brings the same batch back at every judgement, a loss other than ``cross_entropy``::

    >>> first, _ = single_class_suspicion(0, 0, "`head` (Linear)", "head", [32, 4], [1.0, 0, 0, 1, 32], None)
    >>> first.measured
    {'labels': [0, 0]}
    >>> later, _ = single_class_suspicion(100, 0, "`head` (Linear)", "head", [32, 4], [1.0, 1, 2, 1, 12], [0, 0])
    >>> later.finding.details["labels"]
    [[0, 0], [1, 2]]
    >>> single_class_suspicion(100, 0, "`head` (Linear)", "head", [32, 4], [1.0, 0, 0, 1, 32], [0, 0])  # the same
    (None, False)
    >>> single_class_suspicion(100, 100, "`head` (Linear)", "head", [32, 4], [1.0, 0, 3, 0, 1], None)  # shuffled
    (None, True)
    >>> single_class_suspicion(100, 0, "`head` (Linear)", "head", [32, 4], [1.0, 0, 1, 1, 1], [0, 0])  # one row of 1
    (None, False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion

KEY = "single_class"
FORM = 0.9
"""The share of a batch's rows whose gradient must have ``cross_entropy``'s form: all of them but what rounding
takes (a row whose largest probability rounds to 1 has no value below 0)."""
MIN_ROWS = 16
"""Fewer rows are not judged: a batch of one class by chance is then too likely (two classes: 1 in 2^15 here)."""
MIN_RUN = 4
"""The shortest run of one label a batch in label order may hold: a class cut by the batch's edge to fewer rows, or
a minority row after the majority's in unbalanced data, is not judged."""


def single_class_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int],
                           labels: Sequence[float], held: Sequence[int] | None) -> tuple[Suspicion | None, bool]:
    """This judgement's suspicion of ``single_class_batches`` (None when there is none) and whether the run is
    cleared for good. ``labels``: the output gradient's :data:`~lightning_debug.checks.output_gradient.BATCH_LABELS`;
    ``held``: the first and last label of the suspicion held (None when none is); ``since``: the step the hold
    began."""
    share, first, last, in_order, shortest = (float(value) for value in labels)
    if len(shape) != 2:
        return None, True
    if not math.isfinite(share):
        return None, False
    if share < FORM or in_order < 1:
        return None, True
    if shape[0] < MIN_ROWS or shortest < MIN_RUN:
        return None, False
    this = [int(first), int(last)]
    if held is not None and this == list(held):
        return None, False
    finding = None if held is None else Finding(
        Kind.SINGLE_CLASS_BATCHES, Severity.WARNING,
        f"The batch at step {since} holds {_said(held)} and the batch at step {step} {_said(this)}, "
        f"in label order ({shape[0]} rows each, labels read from cross_entropy's gradient of the model's output "
        f"{described}). The training data is sorted by label and the loader does not shuffle it: the model learns "
        "one class at a time and forgets the others, so the training loss looks low while the model answers only "
        "the class it saw last. Pass shuffle=True to the training DataLoader (or a RandomSampler); with an "
        "IterableDataset, shuffle a buffer or the shards.",
        {"modules": [label], "since_step": since, "labels": [list(held), this], "rows": shape[0],
         "labelled_share": share, "shape": list(shape)})
    return Suspicion(Kind.SINGLE_CLASS_BATCHES, KEY, step, finding=finding, measured={"labels": this}), False


def _said(labels: Sequence[int]) -> str:
    first, last = labels
    return f"label {first} alone" if first == last else f"labels {first} then {last}"


__all__ = ["FORM", "KEY", "MIN_ROWS", "MIN_RUN", "single_class_suspicion"]
