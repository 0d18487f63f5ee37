"""The gradient rules fed recorded observations directly: no Trainer, milliseconds each."""

from __future__ import annotations

import math

import torch

from lightning_debug import DebugConfig
from lightning_debug.checks.trends import NormHistory
from lightning_debug.monitors.gradients.exploding import (
    ClipAlgorithm,
    Clipping,
    clipping_note,
    judge_exploding,
    suspect_explosion,
)
from lightning_debug.monitors.gradients.flags import FlagCounter
from lightning_debug.monitors.gradients.layout import ModuleLayout, input_to_output
from lightning_debug.monitors.gradients.missing import judge_missing
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.trainability import (
    FrozenCause,
    frozen_by_optimizer,
    judge_not_updated,
    resting_slots,
    static_frozen_verdicts,
    trainability,
)
from lightning_debug.monitors.gradients.update_ratio import (
    UPDATE_RATIO_LIMIT,
    judge_update_ratios,
    learning_rates,
    overall_ratio,
)
from lightning_debug.monitors.gradients.vanishing import judge_vanishing


def history_of(*norms: float) -> NormHistory:
    history = NormHistory()
    for norm in norms:
        history.add(norm)
    return history


# --- settings ---------------------------------------------------------------------------------------------------
def test_settings_read_the_threshold_only_when_given() -> None:
    assert GradientSettings.from_config(DebugConfig()).explosion_threshold is None
    assert GradientSettings.from_config(DebugConfig()).clip_fallback == 10.0
    given = GradientSettings.from_config(DebugConfig(gradient_explosion_threshold=10.0))
    assert given.explosion_threshold == 10.0 and given.clip_fallback == 10.0
    assert not GradientSettings.from_config(DebugConfig()).measures_updates
    assert GradientSettings.from_config(DebugConfig(log_weights=True)).measures_updates


# --- exploding --------------------------------------------------------------------------------------------------
def test_a_norm_in_line_with_the_history_is_not_exploding() -> None:
    history = history_of(60.0, 58.0, 61.0)
    suspicion = suspect_explosion(65.0, 30.0, history, GradientSettings())
    assert not suspicion.any
    assert judge_exploding(3, 65.0, [], suspicion, GradientSettings(), history, [], None) is None


def test_a_jump_over_the_history_is_exploding_with_a_clip_from_healthy_norms() -> None:
    history = history_of(1.0, 1.2, 0.8)
    suspicion = suspect_explosion(40.0, 35.0, history, GradientSettings())
    verdict = judge_exploding(4, 40.0, [("a", 35.0), ("b", 1.0)], suspicion, GradientSettings(), history,
                              [1.0, 1.2, 0.8, 1.1], None)
    assert verdict is not None
    details = verdict.finding.details
    assert details["judged_by"] == "jump over recent norms" and details["limit"] == 10.0
    assert details["suggested_clip_val"] == 1.2 and details["parameters"] == ["a", "b"]


def test_an_absurd_norm_without_history_is_exploding() -> None:
    suspicion = suspect_explosion(1e5, 1e5, NormHistory(), GradientSettings())
    verdict = judge_exploding(0, 1e5, [("w", 1e5)], suspicion, GradientSettings(), NormHistory(), [], None)
    assert verdict is not None and verdict.finding.details["judged_by"] == "absurd norm"
    assert verdict.finding.details["suggested_clip_val"] == 10.0  # the fallback, no healthy norms yet


def test_the_users_threshold_names_the_parameters_above_it_and_what_clipping_did() -> None:
    settings = GradientSettings(explosion_threshold=5.0)
    suspicion = suspect_explosion(7.0, 6.0, NormHistory(), settings)
    assert suspicion.high and not suspicion.jump
    verdict = judge_exploding(2, 7.0, [("a", 6.0), ("b", 1.0)], suspicion, settings, NormHistory(), [],
                              Clipping(1.0, ClipAlgorithm.NORM))
    assert verdict is not None and verdict.flagged == ["a"]
    details = verdict.finding.details
    assert details["threshold"] == 5.0 and details["suggested_clip_val"] is None
    assert details["clip_algorithm"] == "norm" and details["clip_factor"] == 7.0


def test_clip_algorithm_is_a_string_only_at_the_boundary() -> None:
    assert ClipAlgorithm.parse("value") is ClipAlgorithm.VALUE and ClipAlgorithm.parse("norm") is ClipAlgorithm.NORM
    assert clipping_note(3.0, Clipping(0.5, ClipAlgorithm.VALUE))[1] == {"clip_val": 0.5, "clip_algorithm": "value"}
    assert "did not act" in clipping_note(0.1, Clipping(1.0, ClipAlgorithm.NORM))[0]


# --- vanishing --------------------------------------------------------------------------------------------------
def test_a_zero_parameter_inside_a_learning_module_is_structural() -> None:
    grads = [("attn.key.weight", 0.3), ("attn.key.bias", 0.0)]
    assert judge_vanishing(0, grads, GradientSettings(), {}, "registration order") is None


def test_vanishing_layers_are_named_input_side_first_with_their_neighbours() -> None:
    grads = [("late.weight", 1e-8), ("early.weight", 0.0), ("head.weight", 0.4)]
    positions = {"early.weight": (1, 1), "late.weight": (2, 0), "head.weight": (3, 2)}
    verdict = judge_vanishing(5, grads, GradientSettings(), positions, "forward")
    assert verdict is not None
    details = verdict.finding.details
    assert details["layers"] == ["early", "late"] and details["dead_layers"] == ["early"]
    assert details["healthy_from"] == "head.weight" and details["neighbours"]["late"] == [["head", 0.4]]


# --- missing ----------------------------------------------------------------------------------------------------
def test_missing_names_the_layers_input_side_first() -> None:
    assert judge_missing(0, [], 4, {}) is None
    verdict = judge_missing(3, ["b.weight", "a.weight"], 4, {"a.weight": (0, 0), "b.weight": (1, 1)})
    assert verdict is not None
    assert verdict.finding.details["parameters"] == ["a.weight", "b.weight"]
    assert verdict.finding.details["layers"] == ["a", "b"]


# --- trainability -----------------------------------------------------------------------------------------------
def test_trainability_counts_and_names_the_parameters_frozen_on_purpose() -> None:
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    summary, finding = trainability([("a", torch.nn.Parameter(torch.ones(2))), ("b", frozen)])
    assert summary["trainable_elements"] == 2 and summary["requires_grad_false_names"] == ["b"]
    assert finding is not None and finding.details["elements"] == 3


def test_frozen_by_optimizer_skips_an_optimizer_of_flattened_copies() -> None:
    a = torch.nn.Parameter(torch.ones(1))
    found, check = frozen_by_optimizer([("a", a)], [{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1}])
    assert found == {} and check is not None and check.startswith("skipped")
    found, check = frozen_by_optimizer([("a", a)], [{"params": [a], "lr": 0.0, "initial_lr": 0.1}])
    assert found == {} and check == "done"  # a schedule that starts at 0 is not frozen
    verdicts = static_frozen_verdicts({FrozenCause.LR_ZERO: ["a"]})
    assert verdicts[0].key == "lr_zero" and verdicts[0].finding.details["cause"] == "lr_zero"


def test_not_updated_ignores_parameters_resting_at_lr_zero_and_without_gradient() -> None:
    names = ["a", "b", "c", "d"]
    deltas = torch.tensor([0.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    gradients = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    verdict = judge_not_updated(7, names, deltas, gradients, [True] * 4, [False, True, False, False], set(), {})
    assert verdict is not None and verdict.flagged == ["a"] and verdict.key == "no_update"
    assert judge_not_updated(7, names, deltas, gradients, [True] * 4, [], {"a", "b"}, {}) is None
    a, b = torch.ones(1), torch.ones(1)
    assert resting_slots([{"params": [a], "lr": 0}, {"params": [b], "lr": 0.1}], [a, b]) == [True, False]


# --- update ratio -----------------------------------------------------------------------------------------------
def test_update_ratio_is_judged_per_layer_and_not_for_zero_initialised_weights() -> None:
    layout = ModuleLayout.of(["a.weight", "a.bias", "z.weight"], [torch.ones(4), torch.ones(2), torch.ones(4)])
    deltas = torch.tensor([0.01, 0.05, 1.0], dtype=torch.float64)
    weights = torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64)
    assert judge_update_ratios(0, layout, deltas, weights, [0.1]) is None  # the bias at 0 moves with its weight; z is at 0
    verdict = judge_update_ratios(1, layout, torch.tensor([4.0, 0.0, 0.0], dtype=torch.float64), weights, [10.0])
    assert verdict is not None and verdict.finding.details["ratios"] == {"a": 2.0}
    assert verdict.finding.details["limit"] == UPDATE_RATIO_LIMIT and verdict.flagged == ["a"]


def test_overall_ratio_and_learning_rates() -> None:
    assert overall_ratio(torch.tensor([3.0]), torch.tensor([4.0])) == 0.75
    assert overall_ratio(torch.tensor([math.inf]), torch.tensor([4.0])) is None
    assert learning_rates([{"lr": 0.1}, {"lr": 0.1}, {"lr": torch.tensor(0.2)}]) == [0.1]


# --- helpers ----------------------------------------------------------------------------------------------------
def test_flag_counter_and_order_helpers() -> None:
    counter = FlagCounter(limit=2)
    counter.add(["a", "b", "c"])
    counter.add(["a"])
    assert counter.top(1) == [["a", 2]] and len(counter.counts) <= 2
    assert input_to_output(["x", "y"], {"y": (0, 0)}) == ["y", "x"]
