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

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.gradients import suggest_clip_value
from lightning_debug.checks.trends import ABSURD_GRAD_NORM, NORM_JUMP_FACTOR, NormHistory
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict


class ClipAlgorithm(enum.StrEnum):
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


@dataclass(frozen=True)
class ExplosionSuspicion:
    """What the global norm and the largest norm suggest before per-parameter norms are read.

    ``jump``: the global norm is above the limit learnt from the run's recent norms (``limit``; None
    without enough history, when only an absurd norm counts: above ``absurd``); ``high``: the user's
    threshold is set and a norm is above it (or not finite).
    """

    jump: bool
    high: bool
    limit: float | None
    absurd: float = ABSURD_GRAD_NORM

    @property
    def any(self) -> bool:
        return self.jump or self.high


def suspect_explosion(global_norm: float, largest: float, history: NormHistory,
                      settings: GradientSettings) -> ExplosionSuspicion:
    """Whether this check step may be exploding, from its global and largest norms alone.

    Before the history is long enough, a norm is absurd above :data:`ABSURD_GRAD_NORM` and, when the
    run has a norm or two already, :data:`NORM_JUMP_FACTOR` times the largest of them: a network whose
    convolutions start small under BatchNorm (scale-invariant, so their gradients scale as 1 / ||w||)
    starts near 1e4 and healthy, and a second such norm is no jump.

    Example::

        >>> history = NormHistory(); history.add(6741.0)
        >>> suspect_explosion(1.78e4, 9e3, history, GradientSettings()).jump
        False
    """
    limit = history.limit()
    earlier = [value for value in history.values if math.isfinite(value)]
    absurd = max([ABSURD_GRAD_NORM] + [NORM_JUMP_FACTOR * value for value in earlier])
    jump = math.isfinite(global_norm) and global_norm > (limit if limit is not None else absurd)
    high = settings.explosion_threshold
    suspect_high = high is not None and not (largest <= high and global_norm <= high)  # NaN is suspect too
    return ExplosionSuspicion(jump, suspect_high, limit, absurd)


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
                    healthy_norms: Sequence[float], clipping: Clipping | None) -> Verdict | None:
    """The ``exploding_grad`` finding of a check step, or None when its norms are healthy.

    ``history`` holds the run's recent global norms (this step's not yet added), ``grads`` every
    parameter's norm (read only when the step is suspect). A healthy model's gradient norm varies by
    orders of magnitude between architectures (a ResNet starts near 60, a small MLP near 0.5), so no
    fixed number is used unless the user sets one: the norm must jump 10x over the median of this
    run's recent norms (and 6 robust sigmas), and without history only a norm no model trained with
    a mean loss starts with (1e4) counts.
    """
    high = settings.explosion_threshold
    above = ([(name, norm) for name, norm in grads if math.isfinite(norm) and norm > high]
             if suspicion.high and high is not None else [])
    crossed = suspicion.high and high is not None and math.isfinite(global_norm) and global_norm > high
    if not (above or suspicion.jump or crossed):
        return None
    jump_limit = None if not suspicion.jump else suspicion.limit if suspicion.limit is not None else math.inf
    worst = sorted((item for item in grads if math.isfinite(item[1])), key=lambda item: -item[1])[:WORST_SHOWN]
    named = above or worst
    shown = ", ".join(f"`{name}` {norm:.3g}" for name, norm in worst)
    level = history.level()
    if jump_limit is None:
        what = f"global norm {global_norm:.4g} > gradient_explosion_threshold {high:g}"
    elif math.isfinite(jump_limit):
        what = (f"global norm {global_norm:.4g}, {global_norm / level:.3g}x its median {level:.4g} over the last "
                f"{len(history.values)} check steps (a jump of over {NORM_JUMP_FACTOR:g}x)")
    else:
        what = (f"global norm {global_norm:.4g} at the first check steps, above {ABSURD_GRAD_NORM:g}, which no "
                "model trained with a mean loss starts with" + (
                    f", and over {NORM_JUMP_FACTOR:g}x its earlier norms" if history.values else ""))
    clip_note, clip_details = clipping_note(global_norm, clipping)
    clip: float | None
    if clip_details:
        clip, basis = None, "gradient clipping is already configured"
        fix = ("Lower the learning rate or add a warm-up, normalize the inputs and check the initialization; "
               "look at the batch of this step.")
    else:
        clip, basis = suggest_clip_value(list(healthy_norms), settings.clip_fallback)
        fix = (f"Clip the gradient norm at {clip:g} ({basis}): Trainer(gradient_clip_val={clip:g}) or "
               "torch.nn.utils.clip_grad_norm_; lower the learning rate, normalize the inputs and check the "
               "initialization.")
    return Verdict(Finding(
        Kind.EXPLODING_GRAD, Severity.WARNING,
        f"Gradients are exploding at step {step}: {what}; largest: {shown}.{clip_note} {fix}",
        {"global_norm": global_norm, "threshold": high if jump_limit is None else None,
         "judged_by": ("gradient_explosion_threshold" if jump_limit is None else
                       "jump over recent norms" if math.isfinite(jump_limit) else "absurd norm"),
         "recent_median": level if math.isfinite(level) else None,
         "limit": jump_limit if jump_limit is not None and math.isfinite(jump_limit) else None,
         "parameters": [name for name, _ in named[:NAMES_IN_DETAILS]],
         "worst": [[name, norm] for name, norm in worst], "count": len(named),
         "suggested_clip_val": clip, "clip_basis": basis, **clip_details}),
        [name for name, _ in named])
