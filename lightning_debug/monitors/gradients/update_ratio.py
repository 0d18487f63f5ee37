"""``update_ratio_high``: an optimizer step that moved a layer's weights by more than their own norm.

Example::

    >>> import torch
    >>> layout = ModuleLayout.of(["a.weight", "b.weight"], [torch.ones(4), torch.ones(4)])
    >>> deltas, weights = torch.tensor([5.0, 0.002]), torch.tensor([2.0, 2.0])
    >>> judge_update_ratios(3, layout, deltas, weights, [0.1]).finding.details["ratios"]
    {'a': 2.5}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.layout import ModuleLayout
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict

# A module whose update moves its weights by more than their own norm in one step (healthy: ~1e-3)...
UPDATE_RATIO_LIMIT = 1.0
# ...unless its weights are (near) zero, as zero-initialised biases and tokens are at first.
UPDATE_RATIO_MIN_WEIGHT_RMS = 1e-3


def update_ratios(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``||Δw|| / ||w||`` per parameter: infinite for a zero weight that moved, 0 for one that did not.

    Example::

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
    """``update_ratio_high``: a layer (module) whose step moved its weights by more than their own norm.

    Judged per module, so a zero-initialised bias next to its weight does not count, and only for
    modules whose weights are not (near) zero: a parameter that starts at 0 has an infinite ratio
    on its first step by construction, which would fire on every healthy model.
    """
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
