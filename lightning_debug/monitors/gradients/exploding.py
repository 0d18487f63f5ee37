"""``exploding_grad``: a global gradient norm far above what this run has shown, or above the user's limit.

Example::

    >>> from lightning_debug.checks.trends import NormHistory
    >>> history = NormHistory()
    >>> for norm in (1.0, 1.1, 0.9): history.add(norm)
    >>> suspicion = suspect_explosion(50.0, 40.0, history, GradientSettings())
    >>> suspicion.jump, suspicion.high
    (True, False)
    >>> verdict = judge_exploding(7, 50.0, [("w", 40.0), ("b", 30.0)], suspicion, GradientSettings(), history,
    ...                           healthy_norms=[], clipping=None)
    >>> verdict.finding.details["judged_by"], verdict.flagged
    ('jump over recent norms', ['w', 'b'])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.gradients import clip_advice, suggest_clip_value
from lightning_debug.checks.robust import median
from lightning_debug.checks.trends import NORM_GRADUAL_GROWTH, NORM_JUMP_FACTOR, NORM_TAIL_FACTOR, NormHistory
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.strenum import StrEnum
from lightning_debug.core.verdicts import policy_of
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict


class ClipAlgorithm(StrEnum):
    """How the training loop clips gradients after the checks saw them."""

    NORM = "norm"
    VALUE = "value"

    @classmethod
    def parse(cls, text: str) -> "ClipAlgorithm":
        """Anything but ``"value"`` clips by norm (Lightning's default)."""
        return cls.VALUE if text == cls.VALUE.value else cls.NORM


@dataclass(frozen=True)
class Clipping:
    """The gradient clipping the loop applies: ``value`` and ``algorithm``."""

    value: float
    algorithm: ClipAlgorithm


RUNAWAY_GROWTH = 1000.0
"""A global norm this many times the median of the last :data:`RUNAWAY_CHECKS` check steps' norms runs away:
judged from the second check step on, without the history a jump needs."""
RUNAWAY_CHECKS = 3
OVERFLOW = "finite to non-finite"
"""``judged_by`` of a norm that overflowed (see :func:`overflowed`)."""
OVERFLOW_LOSS_FACTOR = 10.0
"""A norm that turns non-finite while the loss is finite and this many times the largest of the run's first
losses overflowed in an explosion (the loss blew up with it)."""


@dataclass(frozen=True)
class ExplosionSuspicion:
    """What the global norm and the largest norm suggest before per-parameter norms are read.

    ``jump``: the global norm is above the limit learnt from the run's recent norms (``limit``; None
    without enough history, when no jump is judged); ``high``: the user's threshold is set
    and a norm is above it (or not finite); ``confirm``: what the steps after a jump must stay above to
    confirm it (the limit, and :data:`NORM_GRADUAL_GROWTH` times the norm of the check step before it).
    ``runaway``: the level the norm grew :data:`RUNAWAY_GROWTH` times over within the last
    :data:`RUNAWAY_CHECKS` check steps (None when it did not); ``overflow``: the norm turned non-finite
    from a finite one in an explosion (see :func:`overflowed`).
    """

    jump: bool
    high: bool
    limit: float | None
    confirm: float | None = None
    runaway: float | None = None
    overflow: bool = False
    since: int | None = None
    """The finite check step before this one when optimizer steps between them went unchecked (None when it was the
    step right before): a non-finite norm after it overflowed somewhere in between (see :func:`overflowed`)."""

    @property
    def any(self) -> bool:
        return self.jump or self.high or self.runaway is not None or self.overflow

    @property
    def deferred(self) -> bool:
        """Whether the steps after it decide (:data:`FOLLOW_UP_STEPS`): a jump or a finite runaway, not a
        norm over the user's threshold nor one that overflowed, which are recorded at once."""
        return (self.jump or self.runaway is not None) and not (self.high or self.overflow)


def runaway_level(global_norm: float, history: NormHistory) -> float | None:
    """The level ``global_norm`` ran away from: the median of the last :data:`RUNAWAY_CHECKS` finite norms
    when it is :data:`RUNAWAY_GROWTH` times that and above each of them; None otherwise (or without a
    finite norm before it).

    A growth, not a level: a BatchNorm'd network initialised small starts above 1e4 (harmless, scale
    invariant) and falls from there; a healthy run's rare hard batch is 10-200x its median. The median of
    three keeps one near-zero norm (a margin loss on an easy batch) from being the level.

    Example::

        >>> history = NormHistory(); history.add(17.8)
        >>> runaway_level(3.0e6, history), runaway_level(1.5e4, history)
        (17.8, None)
    """
    recent = list(history.values)[-RUNAWAY_CHECKS:]
    if not recent or not math.isfinite(global_norm):
        return None
    level = median(recent)
    return level if global_norm >= RUNAWAY_GROWTH * level and global_norm > max(recent) else None


def rose_before(history: NormHistory) -> float | None:
    """The level the previous check step's norm rose :data:`NORM_JUMP_FACTOR` times over (the median of the up
    to :data:`RUNAWAY_CHECKS` finite norms before it), or None when it did not (or was not finite).

    Example::

        >>> history = NormHistory()
        >>> for norm in (17.8, 16.0, 500.0): history.add(norm)
        >>> rose_before(history)
        16.9
    """
    values = list(history.values)
    if len(values) < 2 or history.last != values[-1]:
        return None
    level = median(values[-RUNAWAY_CHECKS - 1:-1])
    return level if values[-1] >= NORM_JUMP_FACTOR * level else None


def overflowed(global_norm: float, history: NormHistory, loss: float, scaled: bool, unchecked: bool = False) -> bool:
    """Whether a finite norm turned non-finite in an explosion: the check step before was finite, and either
    the loss is still finite and :data:`OVERFLOW_LOSS_FACTOR` times the largest of the run's first losses, or
    the norm had already risen :data:`NORM_JUMP_FACTOR` times on the check step before (:func:`rose_before`;
    then the loss may be non-finite too: it blew up with the gradients), or optimizer steps between the two check
    steps went ``unchecked`` (``gradient_checking_frequency`` over 1).

    Unchecked steps hide how it got there: an MLP under SGD lr 5 goes 17.8, 3.0e6, Inf, NaN in steps 0-3, between
    the default check steps 0 and 100. No healthy run has non-finite gradients, so a finite norm followed by a
    non-finite one with steps unseen between is an explosion into Inf/NaN at the default level, whatever the
    history (it may also be one operation that turned NaN at once: the message says the steps were not checked).

    Not an fp16 overflow under a GradScaler with a finite loss (it finds its scale that way: the step is skipped,
    and ``AnomalyDetectionCallback`` notes it), nor a norm that turns non-finite out of a steady level: with the
    loss where it was it comes from one singular operation (the square root or the norm of a zero vector), and
    with a non-finite loss it follows from the loss (``log(0)``). Both are named ``nonfinite_grad`` /
    ``nonfinite_loss`` by ``AnomalyDetectionCallback`` and stated in report.md as non-finite values measured; an
    explosion that grew 1000x first is named by its growth (:func:`runaway_level`), confirmed by the non-finite
    step at once.

    Example::

        >>> history = NormHistory(); history.add(110.0, loss=14.0)
        >>> overflowed(math.inf, history, 9.0e20, scaled=False), overflowed(math.inf, history, 14.5, scaled=False)
        (True, False)
        >>> history.add(1500.0, loss=20.0)
        >>> overflowed(math.nan, history, math.nan, scaled=False)
        True
        >>> steady = NormHistory(); steady.add(1.0, loss=2.0)
        >>> overflowed(math.nan, steady, math.nan, scaled=False), overflowed(math.nan, steady, math.nan, False, True)
        (False, True)
    """
    if math.isfinite(global_norm) or not math.isfinite(history.last) or (scaled and math.isfinite(loss)):
        return False
    if unchecked:
        return True
    start = max(history.start_losses, default=math.nan)
    blown_up = math.isfinite(loss) and start > 0 and loss >= OVERFLOW_LOSS_FACTOR * start
    return blown_up or rose_before(history) is not None


def suspect_explosion(global_norm: float, largest: float, history: NormHistory,
                      settings: GradientSettings, loss: float = math.nan, scaled: bool = False,
                      since: int | None = None) -> ExplosionSuspicion:
    """Whether this check step may be exploding, from its global and largest norms and its ``loss`` alone
    (a norm that grew into the limit gradually while the loss stayed under its start is no jump: see
    :func:`judge_exploding`); ``scaled``: the loop trains with a GradScaler; ``since``: the previous check step
    when optimizer steps between it and this one were not checked."""
    limit = history.limit()
    jump = (limit is not None and math.isfinite(global_norm) and global_norm > limit
            and not history.grew_while_learning(global_norm, loss))
    high = settings.explosion_threshold
    suspect_high = high is not None and not (largest <= high and global_norm <= high)  # NaN is suspect too
    confirm = max(limit, NORM_GRADUAL_GROWTH * history.values[-1]) if jump and limit is not None else None
    runaway = runaway_level(global_norm, history)
    if confirm is None and runaway is not None:
        confirm = NORM_JUMP_FACTOR * runaway
    overflow = overflowed(global_norm, history, loss, scaled, since is not None)
    return ExplosionSuspicion(jump, suspect_high, limit, confirm, runaway, overflow,
                              since if overflow else None)


def clipping_note(global_norm: float, clipping: Clipping | None) -> tuple[str, dict[str, Any]]:
    """What the loop's own clipping did to this step (the checks see the gradients before it).

    Example::

        >>> clipping_note(4.0, Clipping(1.0, ClipAlgorithm.NORM))[1]
        {'clip_val': 1.0, 'clip_algorithm': 'norm', 'clip_factor': 4.0}
    """
    if clipping is None:
        return "", {}
    value, algorithm = clipping.value, clipping.algorithm
    details: dict[str, Any] = {"clip_val": value, "clip_algorithm": algorithm.value}
    if algorithm is ClipAlgorithm.VALUE:
        return (f" Gradient clipping is on (each element clipped to +-{value:g}, gradient_clip_algorithm='value'); "
                f"the norm above is measured before clipping.", details)
    factor = global_norm / value if value > 0 else math.inf
    if factor > 1:
        details["clip_factor"] = factor
        return (f" Gradient clipping is on (gradient_clip_val={value:g}, by norm): it scaled this step's gradients "
                f"from {global_norm:.4g} down to {value:g}, {factor:.3g}x smaller, so the update stays bounded, "
                "but the gradients themselves are out of scale.", details)
    return f" Gradient clipping is on (gradient_clip_val={value:g}, by norm) and did not act on this step.", details


def judge_exploding(step: int, global_norm: float, grads: Sequence[tuple[str, float]],
                    suspicion: ExplosionSuspicion, settings: GradientSettings, history: NormHistory,
                    healthy_norms: Sequence[float], clipping: Clipping | None,
                    loss: float = math.nan) -> Verdict | None:
    """The ``exploding_grad`` finding of a check step, or None when its norms are healthy.

    ``history`` holds the run's recent global norms (this step's not yet added), ``grads`` every
    parameter's norm (read only when the step is suspect). A healthy model's gradient norm varies by
    orders of magnitude between architectures (a ResNet starts near 60, a small MLP near 0.5), so no
    fixed number is used unless the user sets one: the norm must jump 10x over the median of this
    run's recent norms (and 6 robust sigmas). Before the run has that history (3 check steps) no jump
    is judged: a BatchNorm'd convolution initialised small has a gradient norm above 1e4 at its first
    steps because normalisation makes it scale-invariant (MobileNet), harmless, so no absolute level
    from step 0 can tell an explosion from a healthy start. A growth can: from the second check step on, a
    norm :data:`RUNAWAY_GROWTH` times the median of the (up to 3) check steps before it runs away
    (:func:`runaway_level`: an MLP under SGD lr 5 on unscaled inputs, 17.8 then 3.0e6, then Inf), and a norm
    that turns non-finite with the loss blown up with it overflowed (:func:`overflowed`, ``loss``: this
    step's, NaN when not finite); the overflow is recorded at once, with or without history.

    Nor is a median of the first steps a level: a wide network's norm grows 2x a step out of its
    initialisation for its first ten steps while its loss falls (an MLP of width 1024 with Adam: 1 to 25
    in 4 steps, and 100 with a loss blip it recovers from at once). A norm within 3x of the previous
    check step's, with the loss under the level the run started from, grew into the limit and is not a
    jump. A gradual rise that hurts is still judged: once the loss is above its start (an SGD step too
    large for the curvature doubles the norm every step and quadruples the loss), and any abrupt jump
    at once.

    Nor does the median say how far a healthy run's norms range: near convergence, a batch with a hard example
    has a gradient 10-170x the median on one check step in ten, sometimes three in a row. The limit is also
    3x the norm the run reaches on one check step in 16 lately (:meth:`.NormHistory.routine`), so a jump must
    leave what this run does routinely; a run whose norms stay near their median keeps the median's limit.

    A jump is confirmed by the steps after it (:data:`FOLLOW_UP_STEPS`) when they stay above its limit
    and above 3x the norm of the check step before it: in that rising phase the median lags, and a
    one-step spike that falls back to where the norm was heading (13 -> 68 -> 396 -> 38 while the median
    of the first steps says 3.4) has fallen back. A norm in a settled run sits near its median, so
    there the limit decides.
    """
    high = settings.explosion_threshold
    above = ([(name, norm) for name, norm in grads if math.isfinite(norm) and norm > high]
             if suspicion.high and high is not None else [])
    crossed = suspicion.high and high is not None and math.isfinite(global_norm) and global_norm > high
    runaway = suspicion.runaway
    if not (above or suspicion.jump or crossed or runaway is not None or suspicion.overflow):
        return None
    jump_limit = suspicion.limit if suspicion.jump else None
    worst = sorted((item for item in grads if math.isfinite(item[1])), key=lambda item: -item[1])[:WORST_SHOWN]
    nonfinite = [item for item in grads if not math.isfinite(item[1])]
    named = above or (nonfinite if suspicion.overflow else []) or worst
    shown = ", ".join(f"`{name}` {norm:.3g}" for name, norm in (named if suspicion.overflow else worst)[:WORST_SHOWN])
    level = history.level()
    judged_by = "gradient_explosion_threshold"
    began: list[int] = []
    if suspicion.overflow and suspicion.since is not None:
        judged_by, jump_limit, began = OVERFLOW, None, [suspicion.since + 1]
        unseen = step - suspicion.since - 1
        what = (f"the global norm went from {history.last:.4g} at step {suspicion.since} to non-finite ({global_norm}) "
                f"at step {step}; the {unseen} optimizer step{'s' if unseen != 1 else ''} between were not checked "
                f"(gradient_checking_frequency), so it blew up into Inf/NaN at step {suspicion.since + 1} at the "
                "earliest, or one operation turned NaN there (AnomalyDetectionCallback, checking every step, names "
                "the first non-finite step)")
    elif suspicion.overflow:
        judged_by, jump_limit = OVERFLOW, None
        what = f"global norm {global_norm} from {history.last:.4g} at the check step before"
        rose = rose_before(history)
        if rose is not None:
            what += f", itself {history.last / rose:.3g}x the {rose:.4g} before it"
        start = max(history.start_losses, default=math.nan)
        if math.isfinite(loss) and start > 0:
            what += f", with the loss {loss:.4g}, {loss / start:.3g}x where the run started"
        what += ": the gradients overflowed"
    elif jump_limit is not None:
        judged_by = "jump over recent norms"
        what = (f"global norm {global_norm:.4g}, {global_norm / level:.3g}x its median {level:.4g} over the last "
                f"{len(history.values)} check steps (a jump of over {NORM_JUMP_FACTOR:g}x)")
        routine = history.routine()
        if routine is not None and jump_limit >= NORM_TAIL_FACTOR * routine:
            what += (f" and {global_norm / routine:.3g}x the {routine:.4g} it reaches on one check step in 16 (a jump "
                     f"of over {NORM_TAIL_FACTOR:g}x)")
    elif runaway is not None and not crossed and not above:
        judged_by, jump_limit = "growth over the last check steps", RUNAWAY_GROWTH * runaway
        what = (f"global norm {global_norm:.4g}, {global_norm / runaway:.3g}x the {runaway:.4g} of the check steps "
                f"just before (a growth of over {RUNAWAY_GROWTH:g}x within {RUNAWAY_CHECKS} check steps)")
    else:
        what = f"global norm {global_norm:.4g} > gradient_explosion_threshold {high:g}"
    clip_note, clip_details = clipping_note(global_norm, clipping)
    clip: float | None
    if clip_details:
        clip, basis = None, "gradient clipping is already configured"
        fix = ("Lower the learning rate or add a warm-up, normalize the inputs and check the initialization; "
               "look at the batch of this step.")
    else:
        clip, basis = suggest_clip_value(list(healthy_norms), settings.explosion_threshold)
        fix = clip_advice(clip, basis)
    return Verdict(Finding(
        Kind.EXPLODING_GRAD, Severity.WARNING,
        (f"Gradients exploded between steps {suspicion.since} and {step}" if began else
         f"Gradients are exploding at step {step}") + f": {what}; largest: {shown}.{clip_note} {fix}",
        {"global_norm": global_norm, "threshold": high if judged_by == "gradient_explosion_threshold" else None,
         "judged_by": judged_by,
         "recent_median": level if math.isfinite(level) else None,
         "limit": jump_limit, "confirm_above": suspicion.confirm if jump_limit is not None else None,
         "parameters": [name for name, _ in named[:NAMES_IN_DETAILS]],
         "worst": [[name, norm] for name, norm in worst], "count": len(named),
         "suggested_clip_val": clip, "clip_basis": basis, **clip_details,
         **({"last_finite_step": suspicion.since, "measured_step": step} if began else {})}),
        [name for name, _ in named], steps=began)


FOLLOW_UP_STEPS = policy_of(Kind.EXPLODING_GRAD).follow_up
"""Optimizer steps after a jump that must all still be above its limit (or not finite) to confirm it: the kind's
policy in the table of kinds (:class:`~lightning_debug.core.kinds.Confirm`), applied by the verdict engine;
measured (only their global norm) where they are not check steps themselves.

A healthy model's norm can spike for a step or two and fall back: window attention at a tiny resolution, a model
memorising a small dataset, a rare batch (SwinV2 and SwiftFormer spike 15-100x their level every few steps,
sometimes two steps in a row, while their loss falls). Under Adam a single large gradient does not scale the
update, and under SGD an update that hurts shows in the steps after (the norm stays high, the loss rises, a NaN
follows). An explosion feeds itself, so a jump is reported only once the steps right after it are still above
what confirms it (``confirm_above``: see :func:`judge_exploding`): three steps in a row. A step after it whose
norm is not finite confirms it at once (the engine's invariant: nothing healthy falls back into Inf or NaN). It is
labelled at the step where it began. At the end of the run a jump is reported if the one step seen after it was
still above that, and dismissed if none was seen (a last-step spike cannot be told from an explosion). A limit the
user set (``gradient_explosion_threshold``) is applied at once, without a hold. At most 3 jumps wait per optimizer
(a new one past that decides the oldest with what it has)."""
