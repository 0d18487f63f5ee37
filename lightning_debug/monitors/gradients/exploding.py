"""``exploding_grad``: a global gradient norm far above what this run has shown, or above the user's limit::

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_debug.checks.gradients import clip_advice, suggest_clip_value
from lightning_debug.checks.numerics import fused_norms
from lightning_debug.checks.robust import median
from lightning_debug.checks.trends import NORM_GRADUAL_GROWTH, NORM_JUMP_FACTOR, NORM_TAIL_FACTOR, NormHistory
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.strenum import StrEnum
from lightning_debug.core.numerics import ParameterIndex
from lightning_debug.core.readback import Readback
from lightning_debug.core.verdicts import Confirmed, Suspicion, VerdictEngine, policy_of
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
"""A norm this many times the median of the last :data:`RUNAWAY_CHECKS` check steps' runs away (no history needed)."""
RUNAWAY_CHECKS = 3
RUNAWAY_OVER_WINDOW = 3.0
"""... and this many times every norm of the window (:data:`~lightning_debug.checks.trends.NORM_WINDOW` check
steps): a runaway reaches a height the run has not come near lately, unless the loss did not fall with the norm."""
LOSS_FELL_WITH = 0.1
"""The share of the loss at the window's highest norm under which the loss of a collapsed norm fell with it (see
:func:`runaway_level`)."""
OVERFLOW = "finite to non-finite"
"""``judged_by`` of a norm that overflowed (see :func:`overflowed`)."""
OVERFLOW_LOSS_FACTOR = 10.0
"""A norm that turns non-finite with the loss this many times the largest first loss overflowed (it blew up)."""
EARLY_STEPS = 10
"""The first optimizer steps of the run (its global steps, all optimizers together) whose global norm is measured on
every step, check step or not, and judged for a runaway growth or an overflow (:func:`suspect_early`). A learning
rate far too high (Adam at 1000, SGD at 1e4) or inputs far out of scale blow the norm up 1e3-1e15x within 1-5 steps
of the start, and that can be over (every ReLU dead, the loss back at a plateau or 0) long before the second check
step (100 by default): only those steps show it. Ten cover every such case of the fault benchmark
(benchmarks/faults: steps 1-5), for nine fused norms read back without a sync, once per run; a resumed run does not
watch them again (its global steps are past them, whatever each optimizer's own count says)."""
EARLY_GROWTH = "growth over the first steps"
"""``judged_by`` of a runaway growth on one of the first :data:`EARLY_STEPS` steps."""


@dataclass(frozen=True)
class ExplosionSuspicion:
    """What the global and largest norms suggest before per-parameter norms are read: ``jump`` over the run's
    ``limit``, ``high`` over the user's threshold (or not finite), ``confirm`` what the steps after a jump must stay
    above, ``runaway`` the level it grew from, ``overflow`` (:func:`overflowed`), ``since`` the finite check step
    before it when the steps between went unchecked."""

    jump: bool
    high: bool
    limit: float | None
    confirm: float | None = None
    runaway: float | None = None
    overflow: bool = False
    since: int | None = None

    @property
    def any(self) -> bool:
        return self.jump or self.high or self.runaway is not None or self.overflow

    @property
    def deferred(self) -> bool:
        """Whether the steps after it decide: a jump or a runaway, not a norm over the user's threshold nor one that
        overflowed (recorded at once)."""
        return (self.jump or self.runaway is not None) and not (self.high or self.overflow)


def runaway_level(global_norm: float, history: NormHistory) -> float | None:
    """The level ``global_norm`` ran away from (the median of the last :data:`RUNAWAY_CHECKS` finite norms, when it
    is :data:`RUNAWAY_GROWTH` times that and above each), else None. A growth, not a level: a healthy rare hard batch
    is 10-200x its median, and a median of three keeps one near-zero norm from being the level. Below
    :data:`RUNAWAY_OVER_WINDOW` times a height the window reached, it is a runaway only when the loss did not fall
    with the norm (:func:`fell_with_the_norm`): a loss near 0 for two steps (a saturated classifier) takes the norm
    1e6x down, and the next batch's ordinary norm is no runaway (MobileNetV2 at step 250: 68 after 8e-6 and 4e-5,
    among norms of 20-70); a norm 1e6x down while the loss stays at chance is a broken model, and the jump out of it
    is one (MobileNetV1 at step 6: 7,720 after 0.0025 and 0.0029 at a loss of 0.693, after 4.4e4 at step 1)::

        >>> history = NormHistory(); history.add(17.8, 0.5)
        >>> runaway_level(3.0e6, history), runaway_level(1.5e4, history)
        (17.8, None)
        >>> for norm in (8.3e-6, 3.6e-5): history.add(norm, 1e-6)
        >>> runaway_level(40.0, history), runaway_level(3.0e4, history)
        (None, 3.6e-05)
        >>> broken = NormHistory()
        >>> for norm, loss in ((4.4e4, 2.6), (0.35, 0.69), (0.0025, 0.69), (0.0029, 0.69)): broken.add(norm, loss)
        >>> runaway_level(7720.0, broken)
        0.0029
    """
    recent = list(history.values)[-RUNAWAY_CHECKS:]
    if not recent or not math.isfinite(global_norm):
        return None
    level = median(recent)
    if global_norm < RUNAWAY_GROWTH * level or global_norm <= max(recent):
        return None
    if global_norm > RUNAWAY_OVER_WINDOW * max(history.values) or not fell_with_the_norm(history):
        return level
    return None


def fell_with_the_norm(history: NormHistory) -> bool:
    """Whether the loss of the last :data:`RUNAWAY_CHECKS` norms (their median) is under :data:`LOSS_FELL_WITH` of
    the loss at the window's highest norm: the small norms came from batches the model fits. Not known (no losses, or
    a signed loss) counts as fallen."""
    recent = [loss for loss in list(history.losses)[-RUNAWAY_CHECKS:] if math.isfinite(loss)]
    at_height = history.losses[max(range(len(history.values)), key=history.values.__getitem__)]
    if not recent or not math.isfinite(at_height) or min(recent + [at_height]) < 0:
        return True
    return median(recent) < LOSS_FELL_WITH * at_height


def rose_before(history: NormHistory) -> float | None:
    """The level the previous check step's norm rose :data:`NORM_JUMP_FACTOR` times over (the median of the up
    to :data:`RUNAWAY_CHECKS` finite norms before it), or None when it did not (or was not finite)::

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
    """Whether a finite norm turned non-finite in an explosion: the check step before was finite, and the loss is
    :data:`OVERFLOW_LOSS_FACTOR` times the largest first loss, or the norm had already risen (:func:`rose_before`),
    or steps in between went ``unchecked`` (they hide how it got there). Not a GradScaler's skipped fp16 overflow,
    nor one singular operation out of a steady level: ``nonfinite_grad`` names those::

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
    (a norm that grew into the limit while the loss stayed under its start is no jump); ``since``: the previous
    check step when the steps between were not checked."""
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


def suspect_early(global_norm: float, history: NormHistory, loss: float = math.nan,
                  scaled: bool = False) -> ExplosionSuspicion:
    """Whether one of the first :data:`EARLY_STEPS` steps is exploding, against the norms of the steps before it
    (``history``: each of them, check step or not): a runaway growth (:func:`runaway_level`; or :data:`RUNAWAY_GROWTH`
    times the run's first norm and above every norm since, as a norm growing 10x a step is 1000x its first in 3 steps
    but never 1000x the median of the 3 before) or an overflow (:func:`overflowed`), held and confirmed like those of
    check steps. No jump and no threshold: a healthy model's norm moves several-fold out of its initialisation in its
    first steps, and the user's threshold is applied on check steps::

        >>> history = NormHistory(); history.add(5.5, loss=1.6)
        >>> suspicion = suspect_early(1.35e13, history)
        >>> suspicion.runaway, suspicion.confirm, suspicion.deferred
        (5.5, 55.0, True)
        >>> for norm in (55.0, 550.0): history.add(norm)
        >>> suspect_early(5500.0, history).runaway, suspect_early(30.0, history).any
        (5.5, False)
        >>> suspect_early(math.inf, history, loss=math.nan).overflow  # right after a 10x rise
        True
    """
    runaway = runaway_level(global_norm, history)
    first = history.values[0] if history.values else math.nan
    if (runaway is None and math.isfinite(global_norm) and global_norm >= RUNAWAY_GROWTH * first
            and global_norm > max(history.values)):
        runaway = first
    confirm = None if runaway is None else NORM_JUMP_FACTOR * runaway
    return ExplosionSuspicion(False, False, None, confirm, runaway, overflowed(global_norm, history, loss, scaled))


def clipping_note(global_norm: float, clipping: Clipping | None) -> tuple[str, dict[str, Any]]:
    """What the loop's own clipping did to this step (the checks see the gradients before it)::

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
                    loss: float = math.nan, early: bool = False) -> Verdict | None:
    """The ``exploding_grad`` finding of a check step, or None. ``history``: the run's recent global norms (not
    this step's); ``grads``: every parameter's norm (read only when the step is suspect). Norms differ by orders of
    magnitude between healthy models, so unless the user sets a limit a jump is judged against the run's own norms
    (:meth:`.NormHistory.limit`); see docs/gradients.md. ``early``: one of the first :data:`EARLY_STEPS` steps
    (:func:`suspect_early`), judged against every step before it."""
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
        what = f"global norm {global_norm} from {history.last:.4g} at the {'' if early else 'check '}step before"
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
    elif runaway is not None and not crossed and not above and early:
        judged_by, jump_limit = EARLY_GROWTH, RUNAWAY_GROWTH * runaway
        what = (f"global norm {global_norm:.4g}, {global_norm / runaway:.3g}x the {runaway:.4g} of the steps before it "
                f"(a growth of over {RUNAWAY_GROWTH:g}x within the run's first {EARLY_STEPS} steps, each of which is "
                "measured)")
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
"""Steps after a jump that must stay above its ``confirm_above`` (the kind's policy): healthy models (SwinV2, a rare
batch) spike for a step or two and fall back, an explosion feeds itself."""
Decided = list[tuple[int, Verdict, Any]]
EarlyJudge = Callable[[int, float, list[tuple[str, float]], NormHistory, float], tuple[Verdict | None, bool]]
"""Judges one of the first steps: ``(step, global_norm, grads, history, loss) -> (verdict, deferred)``."""


@dataclass(frozen=True)
class EarlyStep:
    """What one of the first :data:`EARLY_STEPS` steps' reading is judged with: its parameters' ``index`` (their
    names) and ``where`` it ran."""

    index: ParameterIndex
    where: Any


class Explosions:
    """Per optimizer, the jumps held in the verdict engine, and the global norms of the non-check steps after them
    that decide them: one fused norm over the check step's index on the reporting process, read back without a
    sync, no collective (sharded parameters get none); bounded, :data:`FOLLOW_UP_STEPS` per optimizer::

        >>> from torch import nn
        >>> from lightning_debug.core.findings import Finding
        >>> layer = nn.Linear(3, 1)
        >>> layer(torch.ones(2, 3)).sum().backward()
        >>> explosions, index = Explosions(VerdictEngine()), ParameterIndex(list(layer.named_parameters()))
        >>> jump = Verdict(Finding(Kind.EXPLODING_GRAD, Severity.WARNING, "", {"limit": 1.0}))
        >>> explosions.judge(4, None, 40.0, jump, True, {}, index)
        []
        >>> explosions.measure(5, None, lambda: None, lambda optimizer: index)
        >>> [round(reading.values()[0], 3) for _, _, reading, _ in explosions._readings]
        [4.0]
        >>> explosions.measure(6, None, lambda: None, lambda optimizer: index)
        >>> [step for step, _, _ in explosions.read(final=True)]
        [4]

    The first :data:`EARLY_STEPS` steps of the run are measured whether a jump waits or not (their global norm,
    each parameter's and the loss in one reading, no sync) and judged by ``judge_early`` against the steps before
    them, in step order: those of a check step (:meth:`early_norm`) and the others alike::

        >>> early = Explosions(VerdictEngine(), lambda step, norm, grads, history, loss: (None, False))
        >>> early.watch_early(None, index)
        >>> early.early_norm(None, 4.0, math.nan)
        >>> early.early(None, 1), early.watching
        (True, True)
        >>> early.measure(1, None, lambda: None, lambda optimizer: index, where={})
        >>> early.read(), [round(norm, 3) for norm in early._early[None].values]
        ([], [4.0, 4.0])
        >>> early.early(None, EARLY_STEPS), early.watching
        (False, False)
    """

    def __init__(self, verdicts: VerdictEngine, judge_early: EarlyJudge | None = None) -> None:
        self.verdicts = verdicts
        self._judge_early = judge_early
        self._wanted: dict[Any, tuple[ParameterIndex, int]] = {}
        self._readings: list[tuple[int, Any, Readback, EarlyStep | None]] = []
        self._rearm = False
        self._early_index: dict[Any, ParameterIndex] = {}  # per optimizer in its first steps: what they measure
        self._early: dict[Any, NormHistory] = {}  # per optimizer: its norms of the first steps, in step order
        self._losses: tuple[int, list[torch.Tensor]] = (-1, [])  # the loss of this early step's micro-batches

    @property
    def measuring(self) -> bool:
        """Whether a non-check step has anything to measure (one attribute test on every other step)."""
        return self._rearm or bool(self._wanted or self._readings)

    @property
    def watching(self) -> bool:
        """Whether an optimizer may still be in its first steps (one attribute test on every other step)."""
        return bool(self._early_index)

    def watch_early(self, optimizer: Any, index: ParameterIndex | None) -> None:
        """A check step among the first :data:`EARLY_STEPS`: ``optimizer``'s steps after it measure ``index``
        (not sharded parameters: their norm would need a collective)."""
        if index is not None and not index.sharded and len(index):
            self._early_index[optimizer] = index

    def early(self, optimizer: Any, step: int) -> bool:
        """Whether ``step`` (the run's global step) is one of the first, watched for ``optimizer``; past them it is
        watched no more."""
        if optimizer not in self._early_index:
            return False
        if step < EARLY_STEPS:
            return True
        del self._early_index[optimizer]
        return False

    def early_norm(self, optimizer: Any, global_norm: float, loss: float) -> None:
        """A check step among the first ones was judged: its norm joins the steps after it judge against."""
        self._early.setdefault(optimizer, NormHistory()).add(global_norm, loss)

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """A micro-batch loss of an early step that is no check step (no sync)."""
        if self._losses[0] != step:
            self._losses = (step, [])
        if len(self._losses[1]) < 64:
            self._losses[1].append(loss.detach())

    def judge(self, step: int, optimizer: Any, global_norm: float, verdict: Verdict | None, deferred: bool,
              where: Any, index: ParameterIndex | None) -> Decided:
        """A check step's global norm (it follows earlier jumps too) and its verdict: recorded at once, or held for
        the steps after it (``deferred``). An overflow that confirms a jump is that explosion, named where it began."""
        jump = None
        if verdict is not None and deferred:
            details = verdict.finding.details
            jump = Suspicion(Kind.EXPLODING_GRAD, str(step), step, verdict.finding, verdict.flagged, where,
                             value=global_norm, bound=float(details.get("confirm_above") or details["limit"]))
        decided = self._decided(self.verdicts.observe(Kind.EXPLODING_GRAD, step, [jump] if jump else [],
                                                      scope=str(optimizer), reading=global_norm))
        if jump is not None:
            self._want(optimizer, index)
        elif verdict is not None:
            if decided and verdict.finding.details.get("judged_by") == OVERFLOW:
                return decided  # the non-finite step confirmed the jump it follows: named where that began
            decided.append((step, verdict, where))
        return decided

    def _want(self, optimizer: Any, index: ParameterIndex | None) -> None:
        if index is not None and not index.sharded and len(index):
            self._wanted[optimizer] = (index, FOLLOW_UP_STEPS)

    def measure(self, step: int, optimizer: Any, grad_scale: Callable[[], torch.Tensor | None],
                index: Callable[[Any], ParameterIndex], where: Any = None) -> None:
        """A non-check step after a jump, or among the first ones (``where`` it ran given): queue its global norm."""
        if self._rearm:  # resumed while a jump waited: the index its check step used is built again
            self._rearm = False
            if self.verdicts.holding(Kind.EXPLODING_GRAD, str(optimizer)):
                self._want(optimizer, index(optimizer))
        entry = self._wanted.get(optimizer)
        if entry is not None:
            measured, left = entry
            if left <= 1:
                del self._wanted[optimizer]
            else:
                self._wanted[optimizer] = (measured, left - 1)
        watched = self._early_index.get(optimizer) if where is not None else None
        if watched is not None:
            self._readings.append((step, optimizer, self._measure_early(step, watched, grad_scale()),
                                   EarlyStep(watched, where)))
            return
        if entry is None:
            return
        grads, _ = entry[0].local_grads()
        norm = fused_norms(grads).double().square().sum().sqrt()
        scale = grad_scale()
        if scale is not None:
            norm = norm / scale.detach().to(device=norm.device, dtype=norm.dtype)
        self._readings.append((step, optimizer, Readback(norm, blocking=False), None))

    def _measure_early(self, step: int, index: ParameterIndex, scale: torch.Tensor | None) -> Readback:
        """The global norm, the loss (NaN when none was seen) and each parameter's norm, in one reading."""
        grads, _ = index.local_grads()
        norms = fused_norms(grads).double()
        if scale is not None:
            norms = norms / scale.detach().to(device=norms.device, dtype=norms.dtype)
        at, losses = self._losses
        self._losses = (-1, [])
        loss = (torch.stack([value.reshape(()).to(device=norms.device, dtype=norms.dtype) for value in losses]).mean()
                if at == step and losses else torch.full((), math.nan, dtype=norms.dtype, device=norms.device))
        return Readback(torch.cat([norms.square().sum().sqrt().reshape(1), loss.reshape(1), norms]), blocking=False)

    def read(self, final: bool = False, before: int | None = None, until: int | None = None) -> Decided:
        """The jumps decided by the readings that reached the host, in order (``final``: all of them, then every
        jump still waiting). ``before``: a check step whose values have arrived: the readings of the steps before
        it (arrived too) are read first; ``until``: the oldest check step still waiting, which the readings after
        it wait for (the first steps are judged in step order)."""
        decided: Decided = []
        read = 0
        while self._readings:
            step, optimizer, reading, early = self._readings[0]
            if before is not None:
                if step >= before:
                    break
            elif not final and ((until is not None and step > until) or not reading.ready()):
                break
            self._readings.pop(0)
            read += 1
            if early is None:
                decided += self._decided(self.verdicts.observe(Kind.EXPLODING_GRAD, step, scope=str(optimizer),
                                                               reading=reading.values()[0]))
            else:
                decided += self._read_early(step, optimizer, reading.values(), early)
        if read and not self.verdicts.holding(Kind.EXPLODING_GRAD):
            self._wanted.clear()
        if final:
            decided += self._decided(self.verdicts.flush([Kind.EXPLODING_GRAD]))
        return decided

    def _read_early(self, step: int, optimizer: Any, values: list[float], early: EarlyStep) -> Decided:
        """One of the first steps: judged against the steps before it, then one of them; a reading for the jumps
        held before it either way."""
        global_norm, loss = values[0], values[1]
        history = self._early.get(optimizer)
        verdict, deferred = None, False
        if history is not None and self._judge_early is not None:
            verdict, deferred = self._judge_early(step, global_norm, list(zip(early.index.names, values[2:])),
                                                  history, loss)
        self.early_norm(optimizer, global_norm, loss)
        return self.judge(step, optimizer, global_norm, verdict, deferred, early.where, early.index)

    def resumed(self) -> None:
        """A checkpoint was loaded: jumps held in it are measured again from the next step on."""
        self._rearm = self.verdicts.holding(Kind.EXPLODING_GRAD)

    @staticmethod
    def _decided(confirmed: list[Confirmed]) -> Decided:
        return [(c.steps[0], Verdict(c.first.finding, c.first.flagged), c.first.where)
                for c in confirmed if c.first.finding is not None]
