"""``update_ratio_high``: optimizer steps that move a layer's weights by more than their own norm.

A small-initialised convolution under BatchNorm (scale-invariant) moves by several times its norm on its first step
while the loss falls; a learning rate far too high keeps the ratios high or blows the loss up. So a high step is
held under the kind's policy (:func:`confirm_update_ratios`) and labelled at the first high step::

    >>> import torch
    >>> layout = ModuleLayout.of(["a.weight", "b.weight"], [torch.ones(4), torch.ones(4)])
    >>> deltas, weights = torch.tensor([5.0, 0.002]), torch.tensor([2.0, 2.0])
    >>> judge_update_ratios(3, layout, deltas, weights, [0.1]).finding.details["ratios"]
    {'a': 2.5}
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.numerics import HostNumerics
from lightning_debug.core.stats import RunningStats
from lightning_debug.core.verdicts import ConfirmedBy, Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.history import GradientHistory
from lightning_debug.monitors.gradients.layout import ModuleLayout, Positions
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.trainability import judge_not_updated
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict

# A module whose update moves its weights by more than their own norm in one step (healthy: ~1e-3)...
UPDATE_RATIO_LIMIT = 1.0
# ...unless its weights are (near) zero, as zero-initialised biases and tokens are at first.
UPDATE_RATIO_MIN_WEIGHT_RMS = 1e-3
# A high step is confirmed by the next check's loss when it rose by more than this fraction of the step's
# (more than doubled: a small batch's loss varies by +-40% from one batch to the next).
UPDATE_RATIO_LOSS_RISE = 1.0


def update_ratios(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``||Δw|| / ||w||`` per parameter: infinite for a zero weight that moved, 0 for one that did not::

        >>> update_ratios(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2.0, 0.0, 0.0])).tolist()
        [0.5, inf, 0.0]
    """
    return torch.where(weights > 0, deltas / weights.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.where(deltas > 0, math.inf, 0.0))


def overall_ratio(deltas: torch.Tensor, weights: torch.Tensor) -> float | None:
    """The ratio of the whole model's update to its weights (None without weights or with a non-finite update)."""
    delta_squares, weight_squares = float(deltas.square().sum()), float(weights.square().sum())
    if weight_squares > 0 and math.isfinite(delta_squares):
        return math.sqrt(delta_squares / weight_squares)
    return None


def learning_rates(param_groups: Sequence[dict[str, Any]]) -> list[float]:
    """The distinct plain-number learning rates of the param groups, sorted."""
    return sorted({float(g["lr"]) for g in param_groups if isinstance(g.get("lr"), (int, float))})


def judge_update_ratios(step: int, layout: ModuleLayout, deltas: torch.Tensor, weights: torch.Tensor,
                        lrs: Sequence[float]) -> Verdict | None:
    """``update_ratio_high``: a layer (module) whose step moved its weights by more than their own norm; per module
    (a zero-initialised bias beside its weight does not count), not for (near) zero weights (infinite ratio)."""
    moved, size = layout.sums(deltas.square()), layout.sums(weights.square())
    ratio = (moved / size.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
    over = (torch.isfinite(moved) & torch.isfinite(size) & (size > 0) & (ratio > UPDATE_RATIO_LIMIT)
            & ((size / layout.elements.clamp_min(1.0)).sqrt() >= UPDATE_RATIO_MIN_WEIGHT_RMS))
    if not bool(over.any()):
        return None
    high = [(layout.modules[i], float(ratio[i])) for i in over.nonzero().flatten().tolist()]
    high.sort(key=lambda item: -item[1])
    lr_text = f" (learning rate {', '.join(f'{lr:.3g}' for lr in lrs)})" if lrs else ""
    shown = ", ".join(f"`{module or '(root)'}` {ratio:.3g}" for module, ratio in high[:WORST_SHOWN])
    return Verdict(Finding(
        Kind.UPDATE_RATIO_HIGH, Severity.WARNING,
        f"The optimizer step at step {step} changed {len(high)} layer(s) by more than their own weight "
        f"norm (||update|| / ||weight||, healthy around 1e-3): {shown}{lr_text}. The learning rate is far too "
        "high for them: lower it, add a learning-rate warm-up, clip gradients.",
        {"layers": [module for module, _ in high[:NAMES_IN_DETAILS]],
         "ratios": {module: ratio for module, ratio in high[:NAMES_IN_DETAILS]}, "limit": UPDATE_RATIO_LIMIT,
         "learning_rates": list(lrs)}),
        [module or "(root)" for module, _ in high])


def rise_bound(loss: float) -> float:
    """The loss above which the next check step confirms a high step whose own loss was ``loss`` (a rise past
    batch-to-batch noise); infinite when ``loss`` is not finite (only a non-finite loss then confirms it)::

        >>> rise_bound(1.5), rise_bound(-2.0), rise_bound(math.inf)
        (3.0, 0.0, inf)
    """
    return loss + UPDATE_RATIO_LOSS_RISE * abs(loss) if math.isfinite(loss) else math.inf


def confirm_update_ratios(step: int, optimizer: Any, high: Verdict | None, loss: float,
                          verdicts: VerdictEngine) -> Verdict | None:
    """The ``update_ratio_high`` verdict of this check step, if any: ``high`` (:func:`judge_update_ratios`) is held
    and reported when the next check is high too or its ``loss`` rose past :func:`rise_bound` (NaN: not observed)::

        >>> from lightning_debug.core.kinds import Kind, Severity
        >>> verdicts = VerdictEngine()
        >>> high = lambda: Verdict(Finding(Kind.UPDATE_RATIO_HIGH, Severity.WARNING, "high.", {}))
        >>> confirm_update_ratios(0, None, high(), 1.4, verdicts) is None
        True
        >>> confirm_update_ratios(1, None, None, 1.3, verdicts) is None  # one step, the loss fell: healthy
        True
        >>> confirm_update_ratios(2, None, high(), 6.9, verdicts) is None
        True
        >>> confirm_update_ratios(3, None, high(), 900.0, verdicts).steps
        [2, 3]
    """
    if high is not None:
        high.finding.details["loss"] = loss
    suspicions = [] if high is None else [Suspicion(Kind.UPDATE_RATIO_HIGH, "update", step, high.finding,
                                                    high.flagged, bound=rise_bound(loss))]
    confirmed = verdicts.observe(Kind.UPDATE_RATIO_HIGH, step, suspicions, scope=str(optimizer),
                                 reading=None if math.isnan(loss) else loss)
    if not confirmed:
        return None
    verdict = confirmed[0]
    finding = verdict.latest.finding
    assert finding is not None
    if verdict.by in (ConfirmedBy.FOLLOW_UP, ConfirmedBy.NOT_FINITE):  # the loss after it rose, or is not finite
        finding = verdict.first.finding
        assert finding is not None
        finding.message += (f" The loss rose from {finding.details['loss']:.4g} at that step to {loss:.4g} at the "
                            f"next check step ({step}).")
        finding.details.update(confirmed_by="loss rose", next_loss=loss)
        return Verdict(finding, verdict.first.flagged, steps=verdict.steps)
    if verdict.by is ConfirmedBy.PERSISTED and len(verdict.steps) > 1:
        finding.message += f" The ratios were above {UPDATE_RATIO_LIMIT:g} at step {verdict.steps[0]} too."
    finding.details["confirmed_by"] = "persisted"
    return Verdict(finding, verdict.latest.flagged, steps=verdict.steps if len(verdict.steps) > 1 else [])


def step_loss(host: HostNumerics) -> float:
    """The check step's loss: ``inf`` when it was not finite, NaN when no loss was observed."""
    return math.inf if host.ranks_with_nonfinite_loss else host.loss_value if host.loss_checked else math.nan


def read_updates(step: int, optimizer: Any, deltas: torch.Tensor, host: HostNumerics, layout: ModuleLayout | None,
                 had_grad: Sequence[bool], lr_zero_now: Sequence[bool], settings: GradientSettings,
                 history: GradientHistory, param_groups: Sequence[dict[str, Any]], already_frozen: Collection[str],
                 positions: Positions, verdicts: VerdictEngine,
                 line_search: bool = False) -> tuple[dict[str, float], list[Verdict]]:
    """Scalars and verdicts of check step ``step`` from ``deltas`` (``||Δw||`` per parameter slot, after its optimizer
    step): update-ratio scalars, ``update_ratio_high`` and ``frozen_param`` (``no_update``)."""
    deltas = deltas.double()
    weights, names = host.param_norms_by_slot(), host.param_names
    metrics: dict[str, float] = {}
    ratios = update_ratios(deltas, weights)
    if settings.log_weights:
        metrics.update(zip(host.tags("debug/weight/update_ratio/"), ratios.tolist()))
    if settings.keeps_update_ratios:
        for name, ratio in zip(names, ratios.tolist()):
            history.parameter_update_ratios.setdefault(name, RunningStats()).add(ratio)
    overall = overall_ratio(deltas, weights)
    if overall is not None:
        history.update_ratios.add(overall)
        metrics["debug/weight/update_ratio_global"] = overall
    high = (judge_update_ratios(step, layout, deltas, weights, learning_rates(param_groups))
            if layout is not None and layout.slot_module.numel() == len(names) else None)
    verdicts = [confirm_update_ratios(step, optimizer, high, step_loss(host), verdicts),
                judge_not_updated(step, names, deltas, host.grad_norms_by_slot(), had_grad, lr_zero_now,
                                  already_frozen, positions, line_search, weights)]
    return metrics, [verdict for verdict in verdicts if verdict is not None]
