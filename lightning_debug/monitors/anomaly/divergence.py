"""Early divergence: the findings a loss that spikes or climbs turns into, while everything is still
finite (the rule, :class:`~lightning_debug.checks.trends.LossTrend`, is in :mod:`lightning_debug.checks.trends`).

The loss is judged by the anomaly check, which runs every step by default and already reads the
loss's finiteness; its value travels in the same read-back (no extra sync). So a learning rate that
blows the loss up at step 1 is named a step or two later, before anything is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_debug.checks.trends import LossKind, LossVerdict
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity

FIX = ("Lower the learning rate (often by 10x), add a learning-rate warm-up, and clip gradients "
       "(Trainer(gradient_clip_val=1.0) or torch.nn.utils.clip_grad_norm_)")


def _learning_rates(learning_rates: Sequence[float]) -> str:
    rates = sorted({lr for lr in learning_rates if math.isfinite(lr)})
    return f" (learning rate {', '.join(f'{lr:.3g}' for lr in rates)})" if rates else ""


def loss_finding(verdict: LossVerdict, step: int, learning_rates: Sequence[float] = ()) -> Finding | None:
    """``loss_spike``, ``loss_outlier`` or ``loss_divergence`` for a judged loss, None when it shows none; a spike
    or an outlier is about the check step before (``step`` is that step).

    Example::

        >>> from lightning_debug.checks.trends import LossTrend
        >>> trend = LossTrend()
        >>> quiet, _, spike = (loss_finding(trend.judge(loss), 1, [0.5]) for loss in (6.9, 7857.0, 8000.0))
        >>> quiet is None, spike.kind.value, spike.details["learning_rates"], spike.details["next_loss"]
        (True, 'loss_spike', [0.5], 8000.0)
    """
    if verdict.kind is None:
        return None
    lr = _learning_rates(learning_rates)
    jumped = (f"The loss jumped to {verdict.loss:.4g} at step {step}, {verdict.loss / verdict.level:.3g}x its recent "
              f"level {verdict.level:.4g} (the run started at {verdict.start:.4g})")
    if verdict.kind is LossKind.SPIKE:
        after = "" if verdict.next_loss is None else (
            f", and the next check's loss was {verdict.next_loss:.4g}" if math.isfinite(verdict.next_loss)
            else ", and the next check's loss was not finite")
        return Finding(
            Kind.LOSS_SPIKE, Severity.WARNING,
            f"{jumped}{after}{lr}; the step's loss was still finite. This is how a too-high learning rate starts. "
            f"{FIX}.",
            dict(verdict.details, learning_rates=list(learning_rates)))
    if verdict.kind is LossKind.OUTLIER:
        back = ("the run ended before another check" if verdict.next_loss is None
                else f"the next check's loss, {verdict.next_loss:.4g}, was back near that level")
        return Finding(
            Kind.LOSS_OUTLIER, Severity.INFO,
            f"{jumped}{lr}; {back}. One batch far from the others (an outlier target under a squared error, a "
            "mislabelled example, single-example batches of heavy-tailed data); look at that batch if it recurs.",
            dict(verdict.details, learning_rates=list(learning_rates)))
    if verdict.kind is LossKind.DIVERGENCE:
        window = verdict.window or []
        return Finding(
            Kind.LOSS_DIVERGENCE, Severity.WARNING,
            f"The loss is rising steadily: {window[0]:.4g} -> {verdict.loss:.4g} over the last {len(window)} "
            f"checked steps, up to step {step}, above where the run started ({verdict.start:.4g}){lr}. The "
            f"optimizer overshoots. {FIX}; check the sign of the loss and that zero_grad() runs every step.",
            dict(verdict.details, learning_rates=list(learning_rates)))
    if verdict.kind is LossKind.CLIMB:
        return Finding(
            Kind.LOSS_DIVERGENCE, Severity.WARNING,
            f"The loss is climbing through its noise: its level (the median of the last {len(verdict.window or [])} "
            f"checked losses) is {verdict.level:.4g} at step {step}, {verdict.level / verdict.best:.3g}x the best "
            f"level of the run ({verdict.best:.4g}) and above where the run started ({verdict.start:.4g}), and it "
            f"kept rising over the last checks{lr}; everything is still finite. The optimizer overshoots. {FIX}.",
            dict(verdict.details, learning_rates=list(learning_rates), judged_by="smoothed_level"))
    if verdict.kind is LossKind.SETTLED:
        return Finding(
            Kind.LOSS_DIVERGENCE, Severity.WARNING,
            f"The loss is climbing and has settled far above where the run started: its level (the median of the "
            f"last {len(verdict.window or [])} checked losses) is {verdict.level:.4g} at step {step}, "
            f"{verdict.level / verdict.early:.3g}x its early level ({verdict.early:.4g}, the median of its first "
            f"checked losses), on the last checks{lr}; everything is still finite. The optimizer overshoots. {FIX}.",
            dict(verdict.details, learning_rates=list(learning_rates), judged_by="early_level"))
    return None
