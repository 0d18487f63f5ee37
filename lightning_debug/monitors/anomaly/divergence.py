"""Early divergence: a loss that spikes or climbs while everything is still finite (the rule:
:class:`~lightning_debug.checks.trends.LossTrend`), read back with the anomaly check (no extra sync).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from lightning_debug.checks.relapses import RELAPSE_WINDOW
from lightning_debug.checks.trends import (EARLY_RISE_FACTOR, EARLY_RISE_JUDGED_AT, LOSS_START_VALUES, LossKind,
                                           LossTrend, LossVerdict)
from lightning_debug.checks.unbounded import FALL_OCTAVE_FACTOR
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.session import Where
from lightning_debug.core.verdicts import Confirmed, Suspicion, VerdictEngine, policy_of

FIX = ("Lower the learning rate (often by 10x), add a learning-rate warm-up, and clip gradients "
       "(Trainer(gradient_clip_val=1.0) or torch.nn.utils.clip_grad_norm_)")
CLIMB_CHECKS = policy_of(Kind.LOSS_DIVERGENCE).needed() or 1
SPIKE, RISE, CLIMB, SETTLED, OSCILLATING, EARLY, FALL = (  # suspicions' keys
    "spike", "rise", "climb", "settled", "oscillating", "early_rise", "unbounded_fall")


class LossJudge:
    """The loss rule and the monitor's verdict engine: :meth:`judge` returns at most one verdict per check, at the
    check it is about (a spike's or outlier's is the check before; an early rise's the check it crossed 10x the first
    loss at: held from there, with ``confirms=False``, until the first 32 losses say whether it fell back)::

        >>> judge = LossJudge()
        >>> [judge.judge(loss, step).kind for step, loss in enumerate((6.9, 7857.0, 9000.0))]
        [None, None, <LossKind.SPIKE: 'spike'>]
        >>> outlier = LossJudge()
        >>> [outlier.judge(loss, step).kind for step, loss in enumerate((6.9, 7857.0, 6.5))][-1], outlier.step
        (<LossKind.OUTLIER: 'outlier'>, 2)
        >>> ending = LossJudge()
        >>> [ending.judge(loss).kind for loss in (6.9, 7857.0)], [(v.kind.value, v.step) for v in ending.unsettled()]
        ([None, None], [('outlier', 1)])
    """

    def __init__(self, verdicts: VerdictEngine | None = None) -> None:
        self.verdicts = verdicts if verdicts is not None else VerdictEngine()
        self.trend = LossTrend(climb_checks=CLIMB_CHECKS)
        self.step = -1  # the last check step judged (a call without a step takes the next one)

    def judge(self, loss: float, step: int | None = None, where: Where | None = None,
              climb: bool = True) -> LossVerdict:
        """The verdict of check step ``step``; ``climb=False`` leaves the level out (several optimizers)."""
        step = self.step + 1 if step is None else step
        self.step, here = step, {"step": step, "where": where}
        reading, spike = self.trend.judge(loss, climb=climb), None
        if reading.spike is not None and not self.verdicts.holding(Kind.LOSS_SPIKE):
            spike = Suspicion(Kind.LOSS_SPIKE, SPIKE, step, where=where, value=loss, bound=reading.spike.limit,
                              measured=reading.spike.measured())
        settled = self.verdicts.observe(Kind.LOSS_SPIKE, step, [spike] if spike else [], reading=loss)
        levels = [(CLIMB, reading.climb, reading.rising), (SETTLED, reading.settled, True),
                  (OSCILLATING, reading.oscillating, True), (FALL, reading.fall, True)]
        held = [Suspicion(Kind.LOSS_DIVERGENCE, key, step, where=where, confirms=confirms)
                for key, verdict, confirms in levels if verdict is not None]
        if reading.rise_suspected:
            held.append(Suspicion(Kind.LOSS_DIVERGENCE, EARLY, step, where=where,
                                  confirms=reading.early_rise is not None))
        confirmed = {item.key: item for item in self.verdicts.observe(Kind.LOSS_DIVERGENCE, step, held)} \
            if reading.levels_judged else {}
        ordered = [_held_spike(item, LossKind.SPIKE, loss) for item in settled if item.kind is Kind.LOSS_SPIKE]
        ordered += [replace(verdict, **here) for key, verdict in ((RISE, reading.divergence), *[level[:2] for level in levels])
                    if verdict is not None and (key == RISE or key in confirmed)]
        if reading.early_rise is not None and EARLY in confirmed:  # about the check that crossed, where it was held
            crossed = confirmed[EARLY].first
            ordered.append(replace(reading.early_rise, step=crossed.step, where=crossed.where))
        ordered += [_held_spike(item, LossKind.OUTLIER, loss) for item in settled if item.kind is Kind.LOSS_OUTLIER]
        return ordered[0] if ordered else LossVerdict(None, loss, **here)

    def unsettled(self) -> list[LossVerdict]:
        """The end of the run: a spike no check settled is an ``outlier``; a climb still held is dismissed."""
        decided = self.verdicts.flush([Kind.LOSS_SPIKE, Kind.LOSS_DIVERGENCE])
        return [_held_spike(item, LossKind.OUTLIER, None) for item in decided if item.kind is Kind.LOSS_OUTLIER]


def _held_spike(confirmed: Confirmed, kind: LossKind, next_loss: float | None) -> LossVerdict:
    """The verdict on a held spike, about the check it was suspected at."""
    first = confirmed.first
    return LossVerdict(kind, **first.measured, next_loss=next_loss, step=first.step, where=first.where)


def _divergence(message: str, verdict: LossVerdict, learning_rates: Sequence[float],
                judged_by: str | None = None) -> Finding:
    """A ``loss_divergence`` warning with the verdict's numbers and the learning rates (and which rule judged it)."""
    details = dict(verdict.details, learning_rates=list(learning_rates))
    if judged_by is not None:
        details["judged_by"] = judged_by
    return Finding(Kind.LOSS_DIVERGENCE, Severity.WARNING, message, details)


def _learning_rates(learning_rates: Sequence[float]) -> str:
    rates = sorted({lr for lr in learning_rates if math.isfinite(lr)})
    return f" (learning rate {', '.join(f'{lr:.3g}' for lr in rates)})" if rates else ""


def loss_finding(verdict: LossVerdict, step: int, learning_rates: Sequence[float] = ()) -> Finding | None:
    """``loss_spike``, ``loss_outlier`` or ``loss_divergence`` for a judged loss at ``step``, None when it shows none::

        >>> judge = LossJudge()
        >>> quiet, _, spike = (loss_finding(judge.judge(loss), 1, [0.5]) for loss in (6.9, 7857.0, 8000.0))
        >>> quiet is None, spike.kind.value, spike.details["learning_rates"], spike.details["next_loss"]
        (True, 'loss_spike', [0.5], 8000.0)
    """
    if verdict.kind is None:
        return None
    lr = _learning_rates(learning_rates)
    jumped = "" if verdict.kind not in (LossKind.SPIKE, LossKind.OUTLIER) else (
        f"The loss jumped to {verdict.loss:.4g} at step {step}, {verdict.loss / verdict.level:.3g}x its recent "
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
        return _divergence(
            f"The loss is rising steadily: {window[0]:.4g} -> {verdict.loss:.4g} over the last {len(window)} "
            f"checked steps, up to step {step}, above where the run started ({verdict.start:.4g}){lr}. The "
            f"optimizer overshoots. {FIX}; check the sign of the loss and that zero_grad() runs every step.",
            verdict, learning_rates)
    if verdict.kind is LossKind.CLIMB:
        return _divergence(
            f"The loss is climbing through its noise: its level (the median of the last {len(verdict.window or [])} "
            f"checked losses) is {verdict.level:.4g} at step {step}, {verdict.level / verdict.best:.3g}x the best "
            f"level of the run ({verdict.best:.4g}) and above where the run started ({verdict.start:.4g}), and it "
            f"kept rising over the last checks{lr}; everything is still finite. The optimizer overshoots. {FIX}.",
            verdict, learning_rates, "smoothed_level")
    if verdict.kind is LossKind.OSCILLATING:
        peaks = verdict.peaks or []
        listed = ", ".join(f"{peak:.3g}" for peak in peaks)
        return _divergence(
            f"The loss oscillates and does not settle: {len(peaks)} times within the last {RELAPSE_WINDOW} checked "
            f"steps, up to step {step}, it jumped back to where the run started ({verdict.start:.4g}) or above, far "
            f"above its level ({verdict.level:.4g}), and came back down (peaks {listed}){lr}; "
            f"everything is still finite. The optimizer overshoots at this learning rate. {FIX}. (Many bad records, "
            "one batch in 20 far off, look the same: check those batches if the learning rate is not the cause.)",
            verdict, learning_rates, "relapses")
    if verdict.kind is LossKind.EARLY_RISE:
        rise = verdict.rise or []
        listed = ", ".join(f"{loss:.3g}" for loss in rise)
        return _divergence(
            f"The loss rose far above where the run started: {verdict.loss:.4g} at step {step}, "
            f"{verdict.loss / verdict.first_loss:.3g}x the run's first checked loss ({verdict.first_loss:.4g}), within "
            f"its first {LOSS_START_VALUES} checked steps; it stayed at {EARLY_RISE_FACTOR:g}x that or more for "
            f"{len(rise)} checks in a row ({listed}), each of them a spike over the checked losses after them up to "
            f"the {EARLY_RISE_JUDGED_AT}nd (their level {verdict.level:.4g}, the spike limit over them "
            f"{verdict.limit:.4g}){lr}; everything is still finite. The first optimizer steps overshoot: the learning "
            f"rate is too high for the start of training. {FIX}.",
            verdict, learning_rates, "early_rise")
    if verdict.kind is LossKind.UNBOUNDED_FALL:
        fall = verdict.fall or {}
        ladder = ", ".join(f"{value:.4g} at check {at}" for at, value in fall.get("level_at_check", {}).items())
        return _divergence(
            f"The loss falls without bound: its level (the median of the last {len(verdict.window or [])} checked "
            f"losses) is {verdict.level:.4g} at step {step}, {-verdict.level / fall.get('start_magnitude', 1.0):.3g}x "
            f"the largest magnitude of its first checked losses ({fall.get('start_magnitude', math.nan):.4g}), and it "
            f"grew {FALL_OCTAVE_FACTOR:g}x or more in magnitude each time the run doubled ({ladder}){lr}. A loss that can be minimised is bounded below "
            "and levels off; this one has nothing to converge to, so the weights grow until something overflows. "
            "Check the loss's inputs and sign: nll_loss takes log-probabilities (log_softmax, or cross_entropy on "
            "the logits), not raw logits; a maximised term needs a bound.",
            verdict, learning_rates, "unbounded_fall")
    if verdict.kind is LossKind.SETTLED:
        return _divergence(
            f"The loss is climbing and has settled far above where the run started: its level (the median of the "
            f"last {len(verdict.window or [])} checked losses) is {verdict.level:.4g} at step {step}, "
            f"{verdict.level / verdict.early:.3g}x its early level ({verdict.early:.4g}, the median of its first "
            f"checked losses), on the last checks{lr}; everything is still finite. The optimizer overshoots. {FIX}.",
            verdict, learning_rates, "early_level")
    return None
