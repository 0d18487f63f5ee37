"""What one optimizer step did to the weights, read back after it: the update-ratio scalars and
statistics, and the verdicts of the two rules that read the update (``update_ratio_high`` and
``frozen_param``/``no_update``). Tensor operations over every parameter at once; names are paired
with values only for logging and findings.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_debug.core.stats import RunningStats
from lightning_debug.core.numerics import HostNumerics
from lightning_debug.core.verdicts import VerdictEngine
from lightning_debug.monitors.gradients.history import GradientHistory
from lightning_debug.monitors.gradients.layout import ModuleLayout, Positions
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.trainability import judge_not_updated
from lightning_debug.monitors.gradients.update_ratio import (confirm_update_ratios, judge_update_ratios,
                                                             learning_rates, overall_ratio, update_ratios)
from lightning_debug.monitors.gradients.verdict import Verdict


def step_loss(host: HostNumerics) -> float:
    """The check step's loss: ``inf`` when it was not finite, NaN when no loss was observed."""
    return math.inf if host.ranks_with_nonfinite_loss else host.loss_value if host.loss_checked else math.nan


def read_updates(step: int, optimizer: Any, deltas: torch.Tensor, host: HostNumerics, layout: ModuleLayout | None,
                 had_grad: Sequence[bool], lr_zero_now: Sequence[bool], settings: GradientSettings,
                 history: GradientHistory, param_groups: Sequence[dict[str, Any]], already_frozen: Collection[str],
                 positions: Positions, verdicts: VerdictEngine,
                 line_search: bool = False) -> tuple[dict[str, float], list[Verdict]]:
    """Scalars and verdicts of check step ``step`` from ``deltas`` (``||Δw||`` per parameter slot)."""
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
