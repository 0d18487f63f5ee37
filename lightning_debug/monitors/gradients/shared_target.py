"""``learning_stalled`` (``shared_target``): every output of a batch is fitted to one value, and that value changes
from batch to batch: the targets' mean, as when an (N,) target is broadcast against an (N, 1) output
(``mse_loss(output, target)`` compares every output with every target; PyTorch warns once).

The model learns the mean of the targets and nothing of its inputs; its loss falls to their variance and stays, with
nothing non-finite, vanishing or still. What names it is the gradient of an output of one value per row: an affine
function of the output, ``a (o_i - c)``, across the rows
(:func:`~lightning_debug.checks.output_gradient.shared_target`), where a loss with a target per row gives none. A
constant target by design (a least-squares GAN's 0 or 1, a penalty on the outputs) is affine too, at the same ``c``
every time: so a suspicion is held with its ``c`` and confirmed only when the next judgement's ``c`` is another
value; the same ``c`` clears the run for good, as does a gradient of any other form.

Judged with ``loss_at_chance`` (at most once every 100 steps), held two judgements::

    >>> first, _ = shared_target_suspicion(0, 0, "`head` (Linear)", "head", [32, 1], 0.40, [0.2, 0.11], 0.02,
    ...                                    1e-3, held=None)
    >>> first.measured
    {'target': 0.11}
    >>> later, _ = shared_target_suspicion(100, 0, "`head` (Linear)", "head", [32, 1], 0.31, [0.3, -0.04], 0.02,
    ...                                    1e-3, held=0.11)
    >>> later.finding.details["targets"]
    [0.11, -0.04]
    >>> shared_target_suspicion(100, 0, "`d` (Linear)", "d", [32, 1], 0.2, [0.1, 1.0], 0.3, 1e-3, held=1.0)
    (None, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion

KEY = "shared_target"


def shared_target_suspicion(step: int, since: int, described: str, label: str, shape: Sequence[int], loss: float,
                            shared: Sequence[float], scale: float, tolerance: float,
                            held: float | None) -> tuple[Suspicion | None, bool]:
    """This judgement's suspicion of ``shared_target`` (None when there is none) and whether the run is cleared for
    good. ``shared``: the output gradient's :data:`~lightning_debug.checks.output_gradient.SHARED`; ``scale``: the
    output's largest magnitude; ``tolerance``: how far apart two ``c`` are the same value, a share of the largest of
    them and ``scale``; ``held``: the
    ``c`` of the suspicion held (None: none is)."""
    if not shape or math.prod(shape) != shape[0]:
        return None, True
    misfit, target = (list(shared) + [math.nan, math.nan])[:2]
    if not (math.isfinite(misfit) and math.isfinite(target)):
        return None, False
    if misfit > 1:
        return None, True
    if held is None:
        return Suspicion(Kind.LEARNING_STALLED, KEY, step, variant=KEY, measured={"target": target}), False
    if abs(target - held) <= tolerance * max(abs(target), abs(held), scale if math.isfinite(scale) else 0.0):
        return None, True
    finding = Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"Every output of the model's output {described} ({shape[0]} rows, one value each) is fitted to one value "
        f"shared by the batch, and the value changes from batch to batch ({held:.4g} at step {since}, {target:.4g} "
        f"at step {step}; the loss is {loss:.4g}): the loss compares each output with every target, so the model "
        "learns their mean and nothing of its inputs. An (N,) target broadcast against an (N, 1) output is the "
        "usual cause (`mse_loss` and `l1_loss` broadcast, with a warning): give both the same shape, "
        "`output.squeeze(-1)` or `target.unsqueeze(-1)`.",
        {"cause": KEY, "modules": [label], "since_step": since, "loss": loss, "targets": [held, target],
         "misfit": misfit, "rows": shape[0], "shape": list(shape)})
    return Suspicion(Kind.LEARNING_STALLED, KEY, step, finding=finding, variant=KEY, measured={"target": target}), False


__all__ = ["KEY", "shared_target_suspicion"]
