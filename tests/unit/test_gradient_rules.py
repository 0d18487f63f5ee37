"""The gradient rules fed recorded observations directly: no Trainer, milliseconds each."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig
from lightning_debug.checks.trends import NormHistory
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.numerics import ParameterIndex
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.exploding import (
    ClipAlgorithm,
    RUNAWAY_GROWTH,
    Clipping,
    clipping_note,
    judge_exploding,
    overflowed,
    runaway_level,
    suspect_early,
    suspect_explosion,
)
from lightning_debug.monitors.gradients.history import FlagCounter
from lightning_debug.monitors.gradients.exploding import Explosions
from lightning_debug.monitors.gradients.layout import ModuleLayout, input_to_output
from lightning_debug.monitors.gradients.missing import (
    MISSING_CONFIRM_STEPS,
    UNCALLED_CONFIRM_STEPS,
    WAIT_FACTOR,
    MissingHistory,
    judge_intermittent,
    judge_missing,
)
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.stalled import resting_slots
from lightning_debug.monitors.gradients.trainability import (
    FrozenCause,
    frozen_by_optimizer,
    judge_not_updated,
    static_frozen_verdicts,
    trainability,
)
from lightning_debug.monitors.gradients.update_ratio import (
    UPDATE_RATIO_LIMIT,
    confirm_update_ratios,
    judge_update_ratios,
    learning_rates,
    overall_ratio,
)
from lightning_debug.monitors.gradients.verdict import Verdict
from lightning_debug.monitors.gradients.vanishing import VANISHING_DEAD_CHECKS, VanishingHistory, judge_vanishing


class ExplosionWatch:
    """The verdict engine as one optimizer's watch of jumps, as the monitor drives it (tests only)."""

    def __init__(self) -> None:
        self.engine = VerdictEngine()

    def __bool__(self) -> bool:
        return self.engine.holding(Kind.EXPLODING_GRAD)

    def suspect(self, step: int, verdict: Verdict, where: Any, limit: float) -> list[tuple[int, Verdict, Any]]:
        jump = Suspicion(Kind.EXPLODING_GRAD, str(step), step, verdict.finding, verdict.flagged, where, bound=limit)
        return Explosions._decided(self.engine.observe(Kind.EXPLODING_GRAD, step, [jump], judged=()))

    def observe(self, step: int, norm: float) -> list[tuple[int, Verdict, Any]]:
        return Explosions._decided(self.engine.observe(Kind.EXPLODING_GRAD, step, reading=norm))

    def flush(self) -> list[tuple[int, Verdict, Any]]:
        return Explosions._decided(self.engine.flush())


def history_of(*norms: float) -> NormHistory:
    history = NormHistory()
    for norm in norms:
        history.add(norm)
    return history


# --- settings ---------------------------------------------------------------------------------------------------
def test_settings_read_the_threshold_only_when_given() -> None:
    assert GradientSettings.from_config(DebugConfig()).explosion_threshold is None
    given = GradientSettings.from_config(DebugConfig(gradient_explosion_threshold=10.0))
    assert given.explosion_threshold == 10.0
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


def test_without_history_no_norm_is_exploding() -> None:
    """MobileNetV2's first check steps (recorded by the sweep): 1.78e4, its BatchNorm'd convolutions
    initialised small are scale-invariant; the loss falls normally."""
    suspicion = suspect_explosion(1.782e4, 9.13e3, NormHistory(), GradientSettings())
    assert not suspicion.any
    assert judge_exploding(1, 1.782e4, [("w", 9.13e3)], suspicion, GradientSettings(), NormHistory(), [],
                           None) is None


def test_without_history_the_users_threshold_still_counts_and_is_the_clip_suggested() -> None:
    settings = GradientSettings(explosion_threshold=10.0)
    suspicion = suspect_explosion(1e5, 1e5, NormHistory(), settings)
    verdict = judge_exploding(0, 1e5, [("w", 1e5)], suspicion, settings, NormHistory(), [], None)
    assert verdict is not None and verdict.finding.details["judged_by"] == "gradient_explosion_threshold"
    assert verdict.finding.details["suggested_clip_val"] == 10.0


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
    history, verdicts = VanishingHistory(), VerdictEngine()
    assert all(judge_vanishing(s, grads, GradientSettings(), {}, "registration order", history, verdicts) is None
               for s in range(5))


def test_vanishing_layers_are_named_input_side_first_with_their_neighbours() -> None:
    grads = [("late.weight", 1e-8), ("early.weight", 0.0), ("head.weight", 0.4)]
    positions = {"early.weight": (1, 1), "late.weight": (2, 0), "head.weight": (3, 2)}
    history, verdicts = VanishingHistory(), VerdictEngine()
    found = [judge_vanishing(s, grads, GradientSettings(), positions, "forward", history, verdicts) for s in (0, 5, 10)]
    assert found[:2] == [None, None]
    verdict = found[2]
    assert verdict is not None and verdict.steps == [0, 5, 10], "confirmed on the third check, counted on all three"
    details = verdict.finding.details
    assert details["layers"] == ["early", "late"] and details["dead_layers"] == ["early"]
    assert details["healthy_from"] == "head.weight" and details["neighbours"]["late"] == [["head", 0.4]]
    assert details["since_step"] == 0 and "since step 0" in verdict.finding.message
    again = judge_vanishing(15, grads, GradientSettings(), positions, "forward", history, verdicts)
    assert again is not None and again.steps == [], "an ongoing condition is recorded at its own step"


def layer_grads(**norms: float) -> list[tuple[str, float]]:
    return [(f"{layer}.weight", norm) for layer, norm in norms.items()]


# Recorded from ConvNeXt (layer scale 1e-6, AdamW 1e-3), every check every step: the layers behind the scale start
# a million times below their neighbours and grow by orders of magnitude once the scale learns.
CONVNEXT_LAYERNORM = [1e-10, 1e-7, 2e-7, 3e-7, 5e-7, 3e-7, 6e-7, 8e-7, 5e-7, 8e-7, 1e-6, 1e-6, 2e-6, 2e-6, 8e-7]


def test_layers_behind_a_tiny_learnt_scale_wake_up_and_are_not_vanishing() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    for step, norm in enumerate(CONVNEXT_LAYERNORM):
        grads = layer_grads(dwconv=norm * 40, layernorm=norm, pwconv1=norm * 30, classifier=0.2)
        assert judge_vanishing(step, grads, GradientSettings(), {}, "forward", history, verdicts) is None, step


# Recorded from a LoRA adapter on a tiny Llama: lora_A's gradient is exactly zero at step 0 (lora_B = 0).
def test_the_partner_of_a_zero_initialised_layer_is_not_vanishing() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    for step, norm in enumerate([0.0, 2e-3, 3e-3, 2e-3, 4e-3]):
        grads = layer_grads(lora_A=norm, lora_B=0.05, lm_head=0.8)
        assert judge_vanishing(step, grads, GradientSettings(), {}, "forward", history, verdicts) is None


# Recorded from a chain of sigmoids with tiny weights (tests/test_gradients.py): flat, noisy, far below the head.
def test_a_sigmoid_chain_vanishes_once_confirmed() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    chain = [(6e-16, 7e-14), (6e-16, 7e-14), (3e-15, 4e-13), (5e-15, 5e-13)]
    found = [judge_vanishing(step, layer_grads(stem=a, block=b, head=0.1), GradientSettings(), {}, "forward",
                                history, verdicts) for step, (a, b) in enumerate(chain)]
    assert found[:2] == [None, None] and found[2] is not None and found[3] is not None
    assert found[2].finding.details["layers"] == ["stem", "block"] and found[2].steps == [0, 1, 2]


# Recorded from BART (tiny config, AdamW 1e-3), every check every step: the encoder's query and key projections
# get gradients ~1e-3 of their neighbours' while attention is still uniform, and grow only slowly.
BART_Q = [2e-7, 2e-7, 1e-7, 1e-7, 3e-7, 3e-7, 2e-7, 3e-7, 3e-7, 4e-7, 3e-7, 4e-7]


def test_attention_query_and_key_between_healthy_layers_are_a_local_dip() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    for step, q in enumerate(BART_Q):
        grads = layer_grads(embed_tokens=2e-2, layernorm_embedding=3e-4, q_proj=q, k_proj=q * 0.8, v_proj=4e-5,
                            final_layer_norm=3e-4)
        assert judge_vanishing(step, grads, GradientSettings(), {}, "forward", history, verdicts) is None, step


def test_a_model_whose_gradients_are_all_small_is_not_vanishing() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    for step in range(5):
        grads = layer_grads(a=3e-7, b=5e-7, c=8e-7)  # a loss scaled down: the same ratios for the optimizer
        assert judge_vanishing(step, grads, GradientSettings(), {}, "forward", history, verdicts) is None


def test_a_streak_broken_by_one_healthy_check_starts_again() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    norms = [1e-9, 1e-9, 1e-3, 1e-9, 1e-9]
    found = [judge_vanishing(s, layer_grads(a=n, head=0.1), GradientSettings(), {}, "", history, verdicts)
             for s, n in enumerate(norms)]
    assert found == [None] * 5 and verdicts.held_keys(Kind.VANISHING_GRAD) == ["a"]
    restored = VerdictEngine()
    restored.load_state_dict(verdicts.state_dict())
    assert restored.state_dict() == verdicts.state_dict()
    assert [entry["steps"] for entry in restored.state_dict()["held"]] == [[3, 4]]


# Recorded from PhiMoE (sparsemixer's straight-through router): the router's gradient is exactly zero on some
# steps (0-2, 7-8) and healthy on the others, between healthy layers.
def test_a_layer_zero_on_a_few_steps_between_healthy_layers_is_not_dead() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    router = [0.0, 0.0, 0.0, 2e-5, 2e-4, 2e-4, 1e-4, 0.0, 0.0, 4e-4, 5e-5]
    for step, norm in enumerate(router):
        grads = layer_grads(norm_before=2e-3, router=norm, experts=9e-2)
        assert judge_vanishing(step, grads, GradientSettings(), {}, "forward", history, verdicts) is None, step


def test_a_layer_dead_between_healthy_layers_is_reported_after_the_longer_window() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    found = [judge_vanishing(step, layer_grads(before=2e-3, dead=0.0, after=9e-2), GradientSettings(), {}, "",
                                history, verdicts) for step in range(VANISHING_DEAD_CHECKS)]
    assert found[:-1] == [None] * (VANISHING_DEAD_CHECKS - 1) and found[-1] is not None
    assert found[-1].finding.details["dead_layers"] == ["dead"]
    assert found[-1].steps == list(range(VANISHING_DEAD_CHECKS))



# Recorded from BEiT (tiny config, the sweep's 300 steps, every check every step): the class token, which mean
# pooling barely reads, starts at 32.7 and falls under 1e-6 at step 235, when the loss is 1/170 of its start.
BEIT_LOSS = [0.709, 0.0042, 0.0044, 0.0042]
BEIT_CLS = [32.7, 9.1e-7, 6.2e-7, 6.9e-7]


def test_a_layer_that_shrank_as_the_run_converged_is_not_vanishing() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    for step, (loss, cls) in enumerate(zip(BEIT_LOSS, BEIT_CLS)):
        grads = layer_grads(embeddings=cls, projection=1.7e-3, classifier=3.8e-2)
        assert judge_vanishing(step, grads, GradientSettings(), {}, "", history, verdicts, loss=loss,
                               first_loss=BEIT_LOSS[0]) is None, step


@pytest.mark.parametrize("twin", ["loss_still_high", "low_from_the_start", "exactly_zero"])
def test_the_converged_runs_twins_are_still_named(twin: str) -> None:
    """The same shrunken layer while the loss stays up (a mid-run saturation), a layer low from its first check in
    a run that converges (the head learns, the stem never did) and a layer that went exactly zero."""
    losses = [0.709] + ([0.5] * 3 if twin == "loss_still_high" else BEIT_LOSS[1:])
    first = 1e-9 if twin == "low_from_the_start" else BEIT_CLS[0]
    later = {"exactly_zero": 0.0, "low_from_the_start": 2e-9}.get(twin, BEIT_CLS[1])
    history, verdicts = VanishingHistory(), VerdictEngine()
    found = [judge_vanishing(step, layer_grads(embeddings=first if step == 0 else later, projection=1.7e-3,
                                               classifier=3.8e-2), GradientSettings(), {}, "", history, verdicts,
                             loss=loss, first_loss=losses[0])
             for step, loss in enumerate(losses + losses[1:] * 3)]
    assert any(verdict is not None for verdict in found)
    named = next(verdict for verdict in found if verdict is not None)
    assert named.finding.details["layers"] == ["embeddings"]


def test_a_step_whose_loss_is_zero_and_sends_back_nothing_is_not_judged() -> None:
    history, verdicts = VanishingHistory(), VerdictEngine()
    zeros = layer_grads(first=0.0, second=0.0, head=0.0)  # a hinge loss at 0: every margin holds
    for step in range(2 * VANISHING_DEAD_CHECKS):
        assert judge_vanishing(step, zeros, GradientSettings(), {}, "", history, verdicts, loss=0.0) is None
    assert not verdicts.held_keys(Kind.VANISHING_GRAD)
    found = [judge_vanishing(step, zeros, GradientSettings(), {}, "", history, verdicts, loss=2.5)
                for step in range(10, 12)]
    assert found[0] is None and found[1] is not None, "the whole model at 0 under a loss of 2.5: named at once"
    assert "the loss is flat in the model's output" in found[1].finding.message
    assert found[1].steps == [10, 11] and found[1].finding.details["confirm_checks"] == 2


def test_every_gradient_zero_waits_the_longer_window_when_the_loss_is_not_known() -> None:
    """The twin of the flat loss: zeros with no loss read (a step whose loss was not measured) are the dead-layer
    case, which a straight-through router's zero steps must not reach before 8 checks."""
    history, verdicts = VanishingHistory(), VerdictEngine()
    zeros = layer_grads(first=0.0, second=0.0, head=0.0)
    found = [judge_vanishing(step, zeros, GradientSettings(), {}, "", history, verdicts)
             for step in range(VANISHING_DEAD_CHECKS)]
    assert found[:-1] == [None] * (VANISHING_DEAD_CHECKS - 1) and found[-1] is not None


def test_a_norm_of_zero_is_no_level_for_a_jump() -> None:
    history = NormHistory()
    for norm in (0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0.5, 0.6):
        suspicion = suspect_explosion(norm, norm, history, GradientSettings())
        assert judge_exploding(0, norm, [("w", norm)], suspicion, GradientSettings(), history, [], None) is None
        history.add(norm)
    assert list(history.values) == [0.4, 0.5, 0.6] and history.limit() == pytest.approx(5.0)


def test_a_rising_norm_is_judged_from_where_it_rose_to() -> None:
    history = NormHistory()
    for norm, loss in ((1.0, 13.0), (2.1, 11.6), (10.1, 14.8)):
        history.add(norm, loss)
    assert history.limit() == pytest.approx(21.0)
    assert not suspect_explosion(22.4, 22.4, history, GradientSettings(), loss=6.0).jump, "grew 2x, loss falling"
    assert suspect_explosion(22.4, 22.4, history, GradientSettings(), loss=21.0).jump, "the loss above its start"
    abrupt = suspect_explosion(45.0, 45.0, history, GradientSettings(), loss=6.0)
    assert abrupt.jump and abrupt.confirm == pytest.approx(3 * 10.1), "the steps after must stay 3x over 10.1"
    watch = ExplosionWatch()
    verdict = judge_exploding(3, 45.0, [("w", 45.0)], abrupt, GradientSettings(), history, [], None)
    assert verdict is not None and verdict.finding.details["confirm_above"] == pytest.approx(30.3)
    watch.suspect(3, verdict, None, verdict.finding.details["confirm_above"])
    assert watch.observe(4, 90.0) == [] and watch.observe(5, 25.0) == [] and not watch, "fell back to 25 < 30.3"

# The global gradient norm of every step of a healthy fine-tune (transformers' BertForSequenceClassification, 2 layers of
# width 64, AdamW 5e-4 with a linear warm-up and decay, clipped at 1.0, 3 epochs, 97% validation accuracy), recorded
# through AccelerateDebugger with every check every step: near convergence a batch with a hard example has a gradient
# 10-170x the median, sometimes three steps in a row (steps 264-266).
FINE_TUNE_NORMS = (
    0.606, 0.394, 0.347, 0.556, 0.397, 0.485, 0.467, 0.734, 0.5, 0.714, 0.426, 0.358, 0.351, 0.431, 0.568, 0.325,
    0.492, 0.39, 0.411, 0.366, 0.343, 0.409, 0.406, 0.353, 0.399, 0.454, 0.428, 0.382, 0.49, 0.509, 0.556, 0.48,
    0.608, 0.747, 0.478, 0.455, 0.624, 0.728, 0.497, 0.885, 0.722, 0.445, 0.858, 0.358, 0.861, 0.681, 0.381, 0.514,
    0.708, 0.502, 1.135, 0.677, 0.987, 0.583, 0.849, 0.995, 1.081, 0.616, 0.999, 0.603, 0.526, 0.627, 0.607, 0.689,
    0.76, 0.747, 0.752, 1.208, 0.746, 0.981, 0.651, 0.886, 0.802, 1.659, 0.844, 1.091, 0.987, 1.114, 1.031, 1.195,
    1.472, 1.791, 1.307, 1.913, 1.589, 1.471, 2.14, 1.977, 2.779, 5.409, 1.785, 2.142, 2.336, 2.301, 1.863, 2.371,
    2.193, 3.42, 2.926, 4.135, 2.449, 5.36, 4.932, 2.314, 2.164, 2.737, 6.145, 4.04, 4.561, 7.738, 2.115, 3.452,
    4.155, 4.371, 5.841, 5.625, 3.68, 2.32, 4.939, 2.672, 3.704, 2.691, 5.207, 3.662, 2.256, 4.107, 5.966, 2.39,
    1.546, 2.229, 2.663, 3.353, 8.104, 3.853, 2.374, 5.381, 1.577, 7.423, 6.195, 7.81, 2.948, 5.354, 2.261, 2.206,
    3.003, 4.245, 1.867, 3.73, 4.035, 2.401, 1.933, 2.048, 2.447, 4.519, 3.503, 4.48, 2.69, 2.532, 2.127, 3.292,
    11.818, 4.482, 12.057, 0.991, 5.018, 1.955, 1.02, 5.527, 2.986, 5.553, 6.636, 1.172, 2.129, 4.525, 6.539,
    0.912, 3.79, 5.785, 5.405, 16.926, 3.355, 7.526, 5.025, 1.406, 8.068, 7.213, 4.473, 5.671, 1.442, 1.29, 0.933,
    10.666, 3.144, 3.578, 12.518, 7.619, 1.375, 0.778, 2.518, 0.58, 0.768, 1.142, 5.932, 2.281, 0.959, 10.429,
    2.746, 10.772, 0.414, 1.804, 8.684, 8.698, 1.431, 11.963, 1.395, 0.917, 0.765, 3.493, 1.067, 0.532, 0.371,
    0.378, 0.41, 0.662, 0.45, 1.63, 1.938, 10.987, 0.343, 0.662, 11.097, 0.393, 0.419, 1.99, 1.373, 0.502, 0.955,
    0.289, 4.299, 0.312, 0.381, 16.885, 0.304, 0.282, 1.056, 0.518, 0.394, 0.978, 0.602, 0.687, 0.346, 0.262,
    0.271, 4.846, 1.041, 10.525, 0.505, 0.199, 0.259, 0.275, 0.269, 0.242, 0.214, 5.859, 12.517, 11.141, 0.932,
    0.316, 0.247, 0.234, 0.265, 3.077, 0.226, 0.594, 4.212, 0.221, 3.414, 0.25, 0.207, 0.21, 0.283, 0.175, 0.251,
    0.169, 12.021, 0.631, 0.323, 1.245, 2.132, 0.165, 0.182, 0.172, 0.181, 0.227, 0.209, 0.177, 14.169, 0.168,
    0.183, 0.182, 0.28, 0.408, 0.314, 0.266, 0.168, 0.373, 0.38, 0.407, 0.172, 0.175, 0.168, 0.182, 1.282, 0.143,
    0.834, 0.21, 24.603, 0.186, 1.509, 0.213, 1.047, 0.412, 0.159, 0.2, 0.175, 0.195, 0.15, 0.171, 0.161, 0.317,
    0.154, 0.13, 0.208, 0.15, 7.119, 0.159, 0.157, 28.916, 0.141, 0.198, 0.142, 0.146, 0.157, 0.131, 0.205, 0.152,
    0.135, 0.16, 0.608, 0.14, 0.137, 0.246, 0.199, 0.179, 0.202, 0.19, 0.133, 0.812, 0.159, 0.146, 0.162, 0.159,
    0.162, 0.146, 0.148, 0.192, 0.162, 0.153, 0.254, 0.141, 0.143, 0.152, 0.187, 0.138, 0.155, 0.256, 0.238, 0.129,
    0.15, 0.156, 2.317, 0.236, 0.176, 0.165,
)


def replay_exploding(norms: tuple[float, ...] | list[float]) -> list[int]:
    """The steps an exploding_grad is recorded at when every step is a check step, as the monitor judges them."""
    history, watch, recorded = NormHistory(), ExplosionWatch(), []
    for step, norm in enumerate(norms):
        recorded += [began for began, _, _ in watch.observe(step, norm)]
        suspicion = suspect_explosion(norm, norm, history, GradientSettings())
        verdict = judge_exploding(step, norm, [("w", norm)], suspicion, GradientSettings(), history, [], None)
        if verdict is not None:
            watch.suspect(step, verdict, None, verdict.finding.details["confirm_above"])
        history.add(norm)
    return recorded + [began for began, _, _ in watch.flush()]


def test_a_fine_tune_whose_norms_are_heavy_tailed_has_no_explosion() -> None:
    assert replay_exploding(FINE_TUNE_NORMS) == []


def test_an_explosion_in_a_heavy_tailed_run_is_still_named_where_it_began() -> None:
    """The same run, then an update too large: the norm grows 3x a step from step 300 on (as an SGD step past
    the curvature does). It is named when it passes 3x the 12.0 this run reaches on one check step in 16: at step
    304 (44.2); against the median alone it would have been step 302 (4.9, 27x the median 0.18)."""
    exploding = list(FINE_TUNE_NORMS[:300]) + [FINE_TUNE_NORMS[299] * 3.0 ** k for k in range(1, 12)]
    assert replay_exploding(exploding)[:1] == [304]


def replay_with_losses(norms: list[float], losses: list[float], scaled: bool = False) -> list[tuple[int, str]]:
    """``(step, judged_by)`` of every exploding_grad recorded when every step is a check step, with its loss, as the
    monitor decides them (:class:`Explosions`)."""
    history, explosions, recorded = NormHistory(), Explosions(VerdictEngine()), []
    for step, (norm, loss) in enumerate(zip(norms, losses)):
        suspicion = suspect_explosion(norm, norm, history, GradientSettings(), loss=loss, scaled=scaled)
        verdict = judge_exploding(step, norm, [("w", norm)], suspicion, GradientSettings(), history, [], None, loss)
        decided = explosions.judge(step, None, norm, verdict, suspicion.deferred, None, None)
        recorded += [(began, v.finding.details["judged_by"]) for began, v, _ in decided]
        history.add(norm, loss)
    return recorded + [(began, v.finding.details["judged_by"]) for began, v, _ in explosions.read(final=True)]


NAN, INF = math.nan, math.inf
# The MLP (4 hidden layers, SGD lr 5, inputs x100): 17.8, 3.0e6, Inf, then NaN; the loss NaN from step 2.
RUNAWAY_NORMS = [17.8, 3.0e6, INF] + [NAN] * 17
RUNAWAY_LOSSES = [12.2, 5.3e18] + [NAN] * 18


def test_a_norm_that_grows_a_thousandfold_at_the_second_check_step_is_named_where_it_grew() -> None:
    """No history a jump needs (3 check steps): the growth is judged, and the Inf after it confirms it at once."""
    assert replay_with_losses(RUNAWAY_NORMS, RUNAWAY_LOSSES) == [(1, "growth over the last check steps")]
    assert replay_with_losses(RUNAWAY_NORMS, [NAN] * 20) == [(1, "growth over the last check steps")], "no loss"


def replay_early(norms: list[float], losses: list[float] | None = None) -> list[tuple[int, str]]:
    """``(step, judged_by)`` of every exploding_grad recorded over the first steps (step 0 a check step, the others
    measured between check steps and judged by :func:`suspect_early`), as the monitor decides them."""
    history, explosions, recorded = NormHistory(), Explosions(VerdictEngine()), []
    for step, norm in enumerate(norms):
        loss = NAN if losses is None else losses[step]
        verdict, deferred = None, False
        if step:
            suspicion = suspect_early(norm, history, loss)
            verdict = judge_exploding(step, norm, [("w", norm)], suspicion, GradientSettings(), history, [], None,
                                      loss, early=True)
            deferred = suspicion.deferred
        decided = explosions.judge(step, None, norm, verdict, deferred, None, None)
        recorded += [(began, v.finding.details["judged_by"]) for began, v, _ in decided]
        history.add(norm, loss)
    return recorded + [(began, v.finding.details["judged_by"]) for began, v, _ in explosions.read(final=True)]


EARLY = "growth over the first steps"


@pytest.mark.parametrize(("norms", "began"), [
    ([5.5, 1.35e13, 3.91e13, 1.12e13, 1.14e13, 1.52e13, 9.77e12, 3.6e12, 1.2e12, 2.7e12], 1),  # Adam lr 1000
    ([1740.0, 3.62e4, 8.28e5, 4.21e7, 1.61e11, 2.02e18, 0.062, 0.2, 0.0982, 3.28e12], 3),  # inputs x1000, SGD 0.005
    ([0.193, 0.264, 0.612, 10.5, 2320.0, 1.4e9, 1.26e23, NAN, NAN, NAN], 4),  # SGD lr 8, every ReLU dead after
    ([1.0, 10.0, 100.0, 1000.0, 1.0e4, 1.0e5], 3),  # 10x a step: 1000x the first, never the median of the 3 before
], ids=["adam-lr1000", "inputs-x1000", "sgd-lr8", "tenfold-a-step"])
def test_a_thousandfold_growth_in_the_first_steps_is_named_where_it_grew(norms: list[float], began: int) -> None:
    """The fault benchmark's blow-ups in the first steps (global norms recorded every step): named at the step of
    the growth, 1000x the median of the 3 steps before or step 0's, and confirmed by the 2 steps after it."""
    assert replay_early(norms)[0] == (began, EARLY)


@pytest.mark.parametrize("norms", [
    [0.9, 1.9, 4.2, 8.5, 13.0, 68.0, 396.0, 38.0, 30.0, 25.0],  # a wide ReLU MLP rising out of its initialisation
    [9.08, 8.58, 6.59, 6.67, 19.5, 10.3, 14.1, 22.0, 22.5, 33.4],  # a healthy regression, a noisy rise
    [0.525, 26.4, 42.3, 17.1, 6.53, 1.15, 1.76, 1.02, 4.73, 2.07],  # Adam lr 0.2: 80x, no runaway
    [9.71, 6.42, 3.17, 3.09, 4.83, 2.35, 2.71, 2.58, 2.69, 2.26],  # falling from its start
], ids=["wide-relu", "noisy-rise", "eighty-fold", "falling"])
def test_first_steps_that_grow_less_than_a_thousandfold_are_no_explosion(norms: list[float]) -> None:
    assert replay_early(norms) == []


def test_a_nan_out_of_a_steady_norm_in_the_first_steps_is_no_explosion_and_an_overflow_is() -> None:
    """A division by 0 at step 4 (the loss NaN with it) is nonfinite_grad's; a norm that turns Inf with the loss
    blown up 10x over its start overflowed, recorded at once."""
    assert replay_early([0.228, 0.276, 0.224, 0.419, NAN, NAN], [1.4, 1.4, 1.3, 1.3, NAN, NAN]) == []
    assert replay_early([2.0, 2.1, INF, NAN], [1.4, 1.3, 9.0e20, NAN]) == [(2, "finite to non-finite")]


def test_a_norm_that_overflows_with_the_loss_blown_up_is_named_at_once() -> None:
    """110 then Inf at step 1, the loss 9e20 (finite): recorded at the step, not held by the watch."""
    assert replay_with_losses([110.0, INF, NAN, NAN], [14.0, 9.0e20, NAN, NAN]) == [(1, "finite to non-finite")]
    history = history_of(110.0)
    history.start_losses = [14.0]
    suspicion = suspect_explosion(INF, INF, history, GradientSettings(), loss=9.0e20)
    assert suspicion.overflow and not suspicion.deferred
    verdict = judge_exploding(1, INF, [("w", INF), ("b", 3.0)], suspicion, GradientSettings(), history, [], None,
                              9.0e20)
    assert verdict is not None and verdict.flagged == ["w"] and "overflowed" in verdict.finding.message


def test_a_norm_that_rose_tenfold_then_turned_nan_with_the_loss_overflowed_at_the_nan() -> None:
    """17.8, 16.0, then 500 (30x: no runaway, no history for a jump), then NaN with the loss NaN too: the explosion
    is named at the NaN step; its twins below (the same NaN out of a steady norm) are not."""
    assert replay_with_losses([17.8, 16.0, 500.0, NAN, NAN], [12.0, 11.0, 40.0, NAN, NAN]) == [
        (3, "finite to non-finite")]


def test_a_gradient_made_non_finite_by_one_operation_with_a_normal_loss_is_no_explosion() -> None:
    """The twin of the overflow: sqrt of a zero vector sends back NaN while the loss is where it was, and a NaN
    loss makes NaN gradients (named by AnomalyDetectionCallback; report.md states them, see test_measured)."""
    assert replay_with_losses([3.1, 2.9, 3.0, NAN, NAN], [1.2, 1.1, 1.1, 1.0, 1.0]) == []
    assert replay_with_losses([3.1, 2.9, 3.0, NAN, NAN], [1.2, 1.1, 1.1, NAN, NAN]) == []
    assert not overflowed(INF, history_of(3.0), 9.0e20, scaled=False), "no first losses: no level to blow up from"


def test_an_fp16_overflow_under_a_grad_scaler_is_no_explosion() -> None:
    """The GradScaler finds its scale by overflowing: Inf gradients, finite loss, the step skipped."""
    assert replay_with_losses([2.0, INF, 2.1, INF, 2.0], [1.0, 20.0, 1.0, 20.0, 1.0], scaled=True) == []
    assert replay_with_losses([2.0, INF, 2.1], [1.0, 20.0, 1.0]) == [(1, "finite to non-finite")], "its twin"


def test_a_start_above_1e4_that_falls_is_no_growth_and_a_growth_from_it_is() -> None:
    """MobileNetV2's first check steps (1.78e4, scale invariant) stay quiet; the same start, then 1000x more, is
    named at its second check step."""
    start = [1.782e4, 9.1e3, 6.4e3, 5.0e3, 4.2e3]
    assert replay_exploding(start) == []
    assert runaway_level(1.782e4, NormHistory()) is None
    assert replay_with_losses([1.782e4, 2.0e7, 2.5e7, 3.0e7], [2.3, 40.0, 80.0, 90.0]) == [
        (1, "growth over the last check steps")]


def test_growth_is_over_the_median_of_the_last_checks_not_one_tiny_norm() -> None:
    """A margin loss whose easy batch sent back almost nothing (1e-6) is no level: 1.0 after it is no growth.
    Its twin: 1.0 on the same run after steady norms of 1e-4 ran away."""
    assert runaway_level(1.0, history_of(0.9, 1.1, 1e-6)) is None
    assert runaway_level(1.0, history_of(1e-4, 1.2e-4, 1e-4)) == pytest.approx(1e-4)
    assert RUNAWAY_GROWTH == 1000.0


def test_a_finite_growth_that_falls_back_at_once_is_dismissed_and_one_that_stays_is_confirmed() -> None:
    assert replay_exploding([2.0, 2.1, 5.0e3, 2.2, 2.0, 2.1]) == []
    assert replay_exploding([2.0, 2.1, 5.0e3, 4.0e3, 6.0e3, 5.0e3]) == [2]


# --- update ratio persistence -----------------------------------------------------------------------------------
def high_at(step: int, ratio: float) -> Verdict:
    layout = ModuleLayout.of(["conv.weight"], [torch.ones(4)])
    weights = torch.tensor([2.0], dtype=torch.float64)
    verdict = judge_update_ratios(step, layout, torch.tensor([2.0 * ratio], dtype=torch.float64), weights, [0.002])
    assert verdict is not None
    return verdict


# Recorded from MobileNetV2 (SGD 0.002, momentum 0.9), seeds 0-3: ratios 8-14 at step 0, 0.90 at step 1 (momentum
# carries 90% of the first update over weights that grew by it), the loss from 1.53 to 2.16 on one seed.
def test_one_high_step_with_a_loss_that_moves_by_batch_noise_is_not_reported() -> None:
    for loss_0, loss_1 in ((1.8483, 1.8228), (2.1066, 1.2445), (1.5303, 2.1571), (1.4456, 1.2263)):
        history = VerdictEngine()
        assert confirm_update_ratios(0, None, high_at(0, 8.55), loss_0, history) is None
        assert confirm_update_ratios(1, None, None, loss_1, history) is None
        assert confirm_update_ratios(2, None, None, 1.35, history) is None and not history.holding(Kind.UPDATE_RATIO_HIGH)


# AdamW at lr 10 (the zoo's lr_10 plant): ratios far above 1 on consecutive steps, the loss 6.9 -> 1000s.
def test_high_ratios_that_persist_or_blow_the_loss_up_are_reported_at_the_first_high_step() -> None:
    history = VerdictEngine()
    assert confirm_update_ratios(0, None, high_at(0, 40.0), 6.9, history) is None
    verdict = confirm_update_ratios(1, None, high_at(1, 12.0), 2900.0, history)
    assert verdict is not None and verdict.steps == [0, 1] and verdict.finding.details["confirmed_by"] == "persisted"
    ongoing = confirm_update_ratios(2, None, high_at(2, 5.0), math.inf, history)
    assert ongoing is not None and ongoing.steps == []
    history = VerdictEngine()
    confirm_update_ratios(0, None, high_at(0, 40.0), 6.9, history)
    verdict = confirm_update_ratios(1, None, None, math.inf, history)
    assert verdict is not None and verdict.steps == [0] and verdict.finding.details["confirmed_by"] == "loss rose"
    assert "learning rate" in verdict.finding.message


def test_each_optimizer_has_its_own_held_step() -> None:
    history = VerdictEngine()
    assert confirm_update_ratios(0, 0, high_at(0, 3.0), 1.0, history) is None
    assert confirm_update_ratios(1, 1, None, 5.0, history) is None
    assert confirm_update_ratios(2, 0, high_at(2, 3.0), 1.0, history) is not None


# --- missing ----------------------------------------------------------------------------------------------------
def test_missing_names_the_layers_input_side_first() -> None:
    history = MissingHistory()
    assert judge_missing(0, [], 4, {}, history) is None
    history.observe_check(0, None, ["b.weight", "a.weight"], ["a.weight", "b.weight", "c.weight"])
    verdict = judge_missing(3, ["b.weight", "a.weight"], 4, {"a.weight": (0, 0), "b.weight": (1, 1)}, history,
                            newly=["a.weight"])
    assert verdict is not None and verdict.steps == [0]
    assert verdict.finding.details["parameters"] == ["a.weight", "b.weight"]
    assert verdict.finding.details["layers"] == ["a", "b"] and verdict.finding.details["since_step"] == 0
    assert "received no gradient on any of the" in verdict.finding.message


def test_a_layer_cut_off_from_the_loss_is_confirmed_after_the_window_and_labelled_where_it_began() -> None:
    history = MissingHistory()
    everything = ["unused.weight", "head.weight"]
    history.set_called(dict.fromkeys(everything, True), ["unused.weight"])  # its module runs under no_grad()
    assert history.observe_check(0, None, ["unused.weight"], everything).newly_confirmed == []
    confirmed = [history.observe_step(step, [], ["unused.weight"]) for step in range(1, MISSING_CONFIRM_STEPS)]
    assert confirmed[:-1] == [[]] * (MISSING_CONFIRM_STEPS - 2) and confirmed[-1] == ["unused.weight"]
    assert history.candidates["unused.weight"].check_steps == [0]
    later = history.observe_check(10, None, ["unused.weight"], everything)
    assert later.confirmed == ["unused.weight"] and later.intermittent == []


def test_only_a_layer_that_ran_without_a_graph_waits_the_short_window() -> None:
    """A task's head that no batch has sampled yet looks like an unused layer (not called), and a head run on every
    batch whose loss counts on labelled batches only like a layer whose output is detached (ran, output in the
    graph): all wait 64 steps. A layer that ran under no_grad() cannot get a gradient, and waits 8."""
    history = MissingHistory()
    history.set_called({"nograd.w": True, "cut.w": True, "uncalled.w": False}, ["nograd.w"])
    names = ["nograd.w", "cut.w", "uncalled.w", "compiled.w", "trunk.w"]
    history.observe_check(0, None, names[:4], names)
    confirmed = {step: history.observe_step(step, [], names[:4]) for step in range(1, 100)}
    assert {name: step for step, found in confirmed.items() for name in found} == {
        "nograd.w": MISSING_CONFIRM_STEPS - 1, "cut.w": UNCALLED_CONFIRM_STEPS - 1,
        "uncalled.w": UNCALLED_CONFIRM_STEPS - 1, "compiled.w": UNCALLED_CONFIRM_STEPS - 1}
    verdict = judge_missing(99, names[:4], 5, {}, history)
    assert verdict is not None
    details = verdict.finding.details
    assert (details["no_graph"], details["cut_off"], details["not_called"]) == (["nograd.w"], ["cut.w"], ["uncalled.w"])
    assert "without building a graph" in verdict.finding.message and "on rare batches only" in verdict.finding.message
    assert "A layer that is never used" in verdict.finding.message


def test_checks_every_step_confirm_through_the_checks_themselves() -> None:
    history = MissingHistory()
    history.set_called({"unused.weight": True, "head.weight": True}, ["unused.weight"])
    seen = [history.observe_check(step, None, ["unused.weight"], ["unused.weight", "head.weight"])
            for step in range(MISSING_CONFIRM_STEPS)]
    assert [bool(s.newly_confirmed) for s in seen] == [False] * (MISSING_CONFIRM_STEPS - 1) + [True]
    assert history.candidates["unused.weight"].check_steps == list(range(MISSING_CONFIRM_STEPS))


# Recorded from a healthy Switch Transformers run (8 experts, top-1, every check every step): the expert no
# token was routed to at step 0 is routed at step 1, and skipped again at steps 14 and 19.
def test_an_expert_skipped_on_some_steps_is_intermittent_with_its_fraction() -> None:
    history = MissingHistory()
    names = ["experts.expert_4.wi.weight", "experts.expert_2.wi.weight", "router.weight"]
    for step in range(20):
        missing = {0: [names[0]], 14: [names[0]], 19: [names[0], names[1]]}.get(step, [])
        seen = history.observe_check(step, None, missing, names)
        assert not seen.newly_confirmed and not seen.confirmed
        if step == 14:
            assert seen.intermittent == [names[0]]
    assert seen.intermittent == [names[0], names[1]] and seen.candidates == []
    assert history.received_fraction(names[0], None) == 17 / 20
    verdict = judge_intermittent(seen.intermittent, None, {}, history)
    assert verdict is not None and verdict.finding.severity == "info"
    assert verdict.finding.details["received_fraction"][names[1]] == 0.95
    assert history.confirm_the_rest() == []


# Recorded from wav2vec2 with LayerDrop 0.1: layers 0-2 dropped at step 2 after gradients at steps 0 and 1.
def test_a_layer_dropped_on_a_step_is_intermittent() -> None:
    history = MissingHistory()
    names = ["layers.0.q.weight", "layers.3.q.weight"]
    history.observe_check(0, None, [], names)
    history.observe_check(1, None, [], names)
    seen = history.observe_check(2, None, ["layers.0.q.weight"], names)
    assert seen.intermittent == ["layers.0.q.weight"] and seen.candidates == []
    assert round(history.received_fraction("layers.0.q.weight", None), 3) == 0.667


def test_an_expert_unrouted_at_the_first_step_then_routed_is_never_a_candidate_again() -> None:
    history = MissingHistory()
    history.observe_check(0, None, ["expert.w"], ["expert.w", "head.w"])
    assert history.observe_step(1, ["expert.w"], []) == []
    assert "expert.w" not in history.candidates and history.confirm_the_rest() == []
    assert history.observe_check(5, None, ["expert.w"], ["expert.w", "head.w"]).intermittent == ["expert.w"]


def test_missing_history_survives_a_checkpoint() -> None:
    history = MissingHistory()
    history.observe_check(0, None, ["unused.w", "expert.w"], ["unused.w", "expert.w", "head.w"])
    history.observe_step(1, ["expert.w"], ["unused.w"])
    history.loss_reaches = False
    restored = MissingHistory()
    restored.load_state_dict(history.state_dict())
    restored.verdicts.load_state_dict(history.verdicts.state_dict())  # the monitor checkpoints its engine
    assert restored.state_dict() == history.state_dict()
    assert restored.candidates["unused.w"].steps_without == 2 and restored.loss_reaches is False


@pytest.mark.parametrize("reaches, where", [(False, "loss_without_parameters"), (True, "gradients_cleared")])
def test_every_parameter_without_a_gradient_after_a_backward_is_explained_by_the_loss_or_the_order(
        reaches: bool, where: str) -> None:
    """Every trainable parameter: the cause is the loss or the order of zero_grad/backward/step, not an unused
    layer. Fewer than every parameter (the twin) keeps the unused-layer explanation and the DDP note."""
    names = ["a.weight", "b.weight"]
    history = MissingHistory()
    history.set_called(dict.fromkeys(names, True))
    history.loss_reaches = reaches
    history.observe_check(0, None, names, names)
    every = judge_missing(0, names, 2, {}, history)
    assert every is not None and every.finding.details["cause"]["where"] == where
    assert "their output has not reached the loss" not in every.finding.message and "DDP" not in every.finding.message
    assert "ddp" not in every.finding.details
    some = judge_missing(0, names[:1], 3, {}, history)
    assert some is not None and "cause" not in some.finding.details and "ddp" in some.finding.details
    assert "their output has not reached the loss" in some.finding.message and "DDP" in some.finding.message


# --- trainability -----------------------------------------------------------------------------------------------
def test_trainability_counts_and_names_the_parameters_frozen_on_purpose() -> None:
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    summary, finding, accident = trainability([("a", torch.nn.Parameter(torch.ones(2))), ("b", frozen)])
    assert summary["trainable_elements"] == 2 and summary["requires_grad_false_names"] == ["b"]
    assert finding is not None and finding.details["elements"] == 3 and accident == []


def test_the_bulk_of_a_model_frozen_under_an_optimizer_over_every_parameter_is_a_fine_tune_not_an_accident() -> None:
    """peft's LoRA and frozen backbones build ``AdamW(model.parameters())`` and freeze most of it: info, said as
    such; one small layer frozen while the optimizer holds it and the rest trains is the accident (issue 45)."""
    base = torch.nn.Parameter(torch.ones(64), requires_grad=False)
    adapter = torch.nn.Parameter(torch.ones(4))
    summary, finding, accident = trainability([("base", base), ("adapter", adapter)], [{"params": [base, adapter]}])
    assert accident == [] and finding is not None and finding.details["in_optimizer"] == 1
    assert "still in an optimizer param group" in finding.message and summary["requires_grad_false_parameters"] == 1
    layer, rest = torch.nn.Parameter(torch.ones(4), requires_grad=False), torch.nn.Parameter(torch.ones(64))
    summary, finding, accident = trainability([("layer", layer), ("rest", rest)], [{"params": [layer, rest]}],
                                              trainable_before=[layer, rest])
    assert accident == ["layer"] and finding is None and summary["requires_grad_false_parameters"] == 0


def test_a_parameter_built_frozen_is_by_design_even_in_the_optimizer_and_one_frozen_later_is_the_accident() -> None:
    """A module that builds a parameter frozen (a sinusoidal position table; transformers' Marian, Pegasus, the
    Whisper-style audio encoders) sits in ``AdamW(self.parameters())`` harmlessly: info. The same parameter
    trainable when the run first saw the model and frozen since, still held by the optimizer, is a freeze left
    over (issue 45's invariant 6): the accident."""
    table, rest = torch.nn.Parameter(torch.ones(8), requires_grad=False), torch.nn.Parameter(torch.ones(64))
    named, groups = [("table", table), ("rest", rest)], [{"params": [table, rest]}]
    summary, finding, accident = trainability(named, groups, trainable_before=[rest])
    assert accident == [] and finding is not None and finding.details["parameters"] == ["table"]
    assert "built frozen before the run saw the model" in finding.message
    summary, finding, accident = trainability(named, groups, trainable_before=[table, rest])
    assert accident == ["table"] and finding is None and summary["requires_grad_false_in_optimizer"] == 1


def test_frozen_by_optimizer_skips_an_optimizer_of_flattened_copies() -> None:
    a = torch.nn.Parameter(torch.ones(2, 2))
    found, check = frozen_by_optimizer([("a", a)], [{"params": [torch.nn.Parameter(torch.ones(4))], "lr": 0.1}])
    assert found == {} and check is not None and check.startswith("skipped")
    master = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))  # fp32/fp64 masters of a lower precision
    found, check = frozen_by_optimizer([("a", a)], [{"params": [master], "lr": 0.1}])
    assert found == {} and check is not None and check.startswith("skipped")
    found, check = frozen_by_optimizer([("a", a)], [{"params": [a], "lr": 0.0, "initial_lr": 0.1}])
    assert found == {} and check == "done"  # a schedule that starts at 0 is not frozen
    verdicts = static_frozen_verdicts({FrozenCause.LR_ZERO: ["a"]})
    assert verdicts[0].key == "lr_zero" and verdicts[0].finding.details["cause"] == "lr_zero"


def test_an_optimizer_over_a_copy_of_the_layers_leaves_every_trainable_parameter_in_no_group() -> None:
    """tc-optimizer-on-copy (TrainCheck): ``SGD(copy.deepcopy(layers).parameters())``; the pair of the flattened
    copies above, which stay skipped. An optimizer over a subset of the module is no copy."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    found, check = frozen_by_optimizer(named, [{"params": list(copy.deepcopy(model).parameters()), "lr": 0.1}])
    assert found == {FrozenCause.NOT_IN_OPTIMIZER: ["0.weight", "0.bias", "1.weight", "1.bias"]}
    assert check is not None and "copy" in check
    found, check = frozen_by_optimizer(named, [{"params": list(model[1].parameters()), "lr": 0.1}])
    assert found == {FrozenCause.NOT_IN_OPTIMIZER: ["0.weight", "0.bias"]} and check == "done"


def test_not_updated_ignores_parameters_resting_at_lr_zero_and_without_gradient() -> None:
    names = ["a", "b", "c", "d"]
    deltas = torch.tensor([0.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    gradients = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    verdict = judge_not_updated(7, names, deltas, gradients, [True] * 4, [False, True, False, False], set(), {})
    assert verdict is not None and verdict.flagged == ["a"] and verdict.key == "no_update"
    assert judge_not_updated(7, names, deltas, gradients, [True] * 4, [], {"a", "b"}, {}) is None
    still = torch.zeros(4, dtype=torch.float64)  # a line search declined the step: nothing moved
    assert judge_not_updated(7, names, still, gradients, [True] * 4, [], set(), {}, line_search=True) is None
    assert judge_not_updated(7, names, deltas, gradients, [True] * 4, [], set(), {}, line_search=True) is not None
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    at_precision = torch.tensor([0.0, 0.0, 0.0, 1e-7], dtype=torch.float64)  # the tail of a decay to 0
    assert judge_not_updated(7, names, at_precision, gradients, [True] * 4, [], set(), {}, weights=weights) is None
    assert judge_not_updated(7, names, deltas, gradients, [True] * 4, [], set(), {}, weights=weights) is not None
    a, b = torch.ones(1), torch.ones(1)
    assert resting_slots([{"params": [a], "lr": 0}, {"params": [b], "lr": 0.1}], [a, b]) == [True, False]
    assert resting_slots([{"params": [a], "lr": 5e-9, "initial_lr": 0.05}], [a]) == [True]  # 0 in effect
    assert resting_slots([{"params": [a], "lr": 5e-9}], [a], start_lrs=[1e-8]) == []  # a small base: its own rate


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


# --- weight decay on biases, norms and embeddings ---------------------------------------------------------------
def test_weight_decay_names_biases_norm_gains_and_embeddings_by_structure() -> None:
    from lightning_debug.monitors.gradients.weight_decay import judge_weight_decay

    embedding, linear, norm = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    scale = torch.nn.Parameter(torch.ones(4))  # a custom norm's gain: one dimension, any module
    named = [("emb.weight", embedding.weight, embedding), ("fc.weight", linear.weight, linear),
             ("fc.bias", linear.bias, linear), ("ln.weight", norm.weight, norm), ("rms.scale", scale, None)]
    everything = [p for _, p, _ in named]
    finding = judge_weight_decay(named, [{"params": everything, "weight_decay": 0.1}])
    assert finding is not None and finding.severity.value == "info"
    assert finding.details["parameters"] == ["emb.weight", "fc.bias", "ln.weight", "rms.scale"]
    assert finding.details["roles"] == {"embedding": 1, "bias or normalization": 3}


def test_weight_decay_of_zero_frozen_parameters_and_foreign_copies_are_not_judged() -> None:
    from lightning_debug.monitors.gradients.weight_decay import judge_weight_decay

    linear = torch.nn.Linear(4, 4)
    linear.bias.requires_grad_(False)
    flat = torch.nn.Parameter(torch.zeros(20))  # a flattened copy the module does not name
    named = [("fc.weight", linear.weight, linear), ("fc.bias", linear.bias, linear)]
    assert judge_weight_decay(named, [{"params": [linear.weight, linear.bias, flat], "weight_decay": 0.1}]) is None
    assert judge_weight_decay(named, [{"params": [linear.weight, linear.bias], "weight_decay": 0}]) is None
    assert judge_weight_decay(named, []) is None


# --- learning stalled ---------------------------------------------------------------------------------------------
def test_a_learning_rate_at_zero_mid_run_is_a_stall_once_it_lasted_two_checks_and_1_percent_of_the_run() -> None:
    from lightning_debug.monitors.gradients.stalled import judge_stalled

    history, groups = VerdictEngine(), [{"params": [torch.zeros(1)], "lr": 0.0, "initial_lr": 0.1}]
    found = [judge_stalled(step, groups, history, 1000, ["LambdaLR"]) for step in (10, 11, 19, 20)]
    assert found[:3] == [None, None, None] and found[3] is not None
    details = found[3].finding.details
    assert details["since_step"] == 10 and details["initial_lr"] == [0.1] and details["schedulers"] == ["LambdaLR"]
    groups[0]["lr"] = 0.05  # the schedule comes back: the streak ends
    assert judge_stalled(111, groups, history, 1000, []) is None and not history.held_keys(Kind.LEARNING_STALLED)


def test_a_decay_that_never_ends_is_named_a_check_later_and_a_warm_restart_is_not_a_stall() -> None:
    """Checked every step, a cosine schedule with warm restarts (``T_0=5000`` in a run of 6,000 steps) is under 1e-6
    of its base for its cycle's last 3 steps, which three check steps in a row used to confirm; a stall must last
    1% of the run (60 steps). Its twin, ``ReduceLROnPlateau(mode="max")`` stepped on a falling loss, halves the lr at
    every patience and is named on the second check step 100 steps apart, where three used to be needed."""
    from lightning_debug.monitors.gradients.stalled import judge_stalled

    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.05)
    restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=5000)
    engine, found = VerdictEngine(), []
    for step in range(6000):
        found.append(judge_stalled(step, optimizer.param_groups, engine, 6000, ["CosineAnnealingWarmRestarts"]))
        optimizer.step()
        restarts.step()
    assert not any(found)
    optimizer = torch.optim.SGD([weight], lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=5, factor=0.5)
    engine, named = VerdictEngine(), {}
    for step in range(400):
        if step % 100 == 0:
            named[step] = judge_stalled(step, optimizer.param_groups, engine, 400, ["ReduceLROnPlateau"],
                                        start_lrs=[0.05])
        optimizer.step()
        plateau.step(1.4 - step / 1000)
    assert [step for step, verdict in named.items() if verdict is not None] == [300]
    assert "mode='max'" in named[300].finding.message


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_plateau_schedule_that_ends_a_fitted_run_is_no_stall(mode: str) -> None:
    """``ReduceLROnPlateau`` stepped on a training loss that reaches 0 by step 60: ``mode="min"`` cuts the lr from
    there, a millionth of its base by step 200, with the last loss read 1e-5 of its first (a fit): quiet. Its twin
    in ``mode="max"`` cuts it from the start while the loss is 1e-2 of its first and is named on the second check."""
    from lightning_debug.monitors.gradients.stalled import judge_stalled

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode=mode, patience=5, factor=0.5)
    engine, named, first = VerdictEngine(), {}, 1.4
    for step in range(400):
        loss = max(first * (1 - step / 60), 1e-5 if mode == "min" else 1.4e-2)
        if step % 100 == 0:
            named[step] = judge_stalled(step, optimizer.param_groups, engine, 400, ["ReduceLROnPlateau"],
                                        start_lrs=[0.05], losses=(loss, first))
        plateau.step(loss)
    assert optimizer.param_groups[0]["lr"] <= 1e-6 * 0.05, "the plant: the lr 0 in effect"
    assert [step for step, verdict in named.items() if verdict is not None] == ([] if mode == "min" else [300])


def test_what_a_stall_is_not() -> None:
    from lightning_debug.monitors.gradients.stalled import judge_stalled

    zero = {"params": [torch.zeros(1)], "lr": 0.0, "initial_lr": 0.1}
    learning = {"params": [torch.zeros(1)], "lr": 0.01, "initial_lr": 0.1}
    ending = VerdictEngine()  # a cosine schedule reaching 0 in its last steps
    assert all(judge_stalled(step, [zero], ending, 1000, []) is None for step in range(900, 1000))
    unknown = VerdictEngine()  # no known end: a stall cannot be told from an ending
    assert all(judge_stalled(step, [zero], unknown, None, []) is None for step in range(10, 200))
    frozen_on_purpose = VerdictEngine()
    assert all(judge_stalled(step, [zero, learning], frozen_on_purpose, 60, []) is None for step in range(10))
    never = VerdictEngine()  # a base lr of 0 from the start is frozen_param, said at fit start
    base_zero = {"params": [torch.zeros(1)], "lr": 0.0, "initial_lr": 0.0}
    assert all(judge_stalled(step, [base_zero], never, 60, []) is None for step in range(10))


def test_a_learning_rate_set_to_zero_without_a_scheduler_is_a_stall_and_one_zero_from_the_start_is_not() -> None:
    """Issue 45: code that sets every group's lr to 0 mid-run (no scheduler, so no ``initial_lr``) stalls the run
    as a scheduler reaching 0 does; its twin, a group whose lr was 0 when training started, stays frozen_param's."""
    from lightning_debug.monitors.gradients.stalled import judge_stalled

    zeroed = [{"params": [torch.zeros(1)], "lr": 0.0}]
    history = VerdictEngine()
    found = [judge_stalled(step, zeroed, history, 400, [], start_lrs=[0.05]) for step in (100, 200, 300)]
    assert found[0] is None and found[1] is not None
    finding = found[1].finding
    assert finding.details["since_step"] == 100 and finding.details["initial_lr"] == [0.05]
    assert "no scheduler" in finding.message
    from_start = VerdictEngine()
    assert all(judge_stalled(step, zeroed, from_start, 400, [], start_lrs=[0.0]) is None for step in (100, 200, 300))
    assert not from_start.held_keys(Kind.LEARNING_STALLED)


def test_a_learning_rate_far_too_small_is_a_stall_and_its_twins_are_not() -> None:
    """Issue 45 (slow convergence): weights that move by 1e-7 of their size per step at lr > 0 while the loss stays
    where it started are ``learning_stalled`` after three check steps; the same drift after the loss fell (a converged
    model), in a warm-up's first steps, at the end of the run or with the lr at 0 (the other stall) is not."""
    from lightning_debug.monitors.gradients.progress import Drift, WeightDrift, judge_progress

    frozen = Drift(moved=1e-7 * 100 * 5.0, size=5.0, steps=100)
    engine = VerdictEngine()
    found = [judge_progress(step, frozen, 1.39, 1.40, [(1e-6, 1e-6)], engine, 400) for step in (100, 200, 300)]
    assert found[:2] == [None, None] and found[2] is not None
    finding = found[2].finding
    assert finding.kind is Kind.LEARNING_STALLED and finding.details["since_step"] == 100
    assert finding.details["cause"] == "negligible_updates" and finding.details["learning_rates"] == [1e-6]
    healthy = Drift(moved=1e-3 * 100 * 5.0, size=5.0, steps=100)
    twins = {
        "converged": (frozen, 0.01, [(0.05, 0.05)], 400),
        "learning": (healthy, 1.39, [(0.05, 0.05)], 400),
        "warm-up start": (frozen, 1.39, [(1e-6, 1e-3)], 400),
        "lr zero": (frozen, 1.39, [(0.0, 0.05)], 400),
        "run's end": (frozen, 1.39, [(1e-6, 1e-6)], 320),
    }
    for name, (drift, loss, lrs, total) in twins.items():
        twin = VerdictEngine()
        assert all(judge_progress(step, drift, loss, 1.40, lrs, twin, total) is None for step in (100, 200, 300)), name
    still = VerdictEngine()  # weights that do not move at all: no small lr, the optimizer does not step them
    moved_none = [judge_progress(step, Drift(0.0, 5.0, 100), 1.39, 1.40, [(0.05, 0.05)], still, 400)
                  for step in (100, 200, 300)]
    assert moved_none[2] is not None and "did not move at all" in moved_none[2].finding.message
    noisy = VerdictEngine()  # bit for bit still while single batches' losses wander below 90% of the first
    found = [judge_progress(step, Drift(0.0, 5.0, 100), loss, 20.2, [(1e-3, 1e-3)], noisy, 400)
             for step, loss in ((100, 5.3), (200, 9.7), (300, 10.3))]
    assert found[2] is not None and "bit for bit" in found[2].finding.message and "max_norm 0" in found[2].finding.message
    unstepped = VerdictEngine()  # the same stillness with no optimizer step counted: optimizer_not_stepping's case
    assert all(judge_progress(step, Drift(0.0, 5.0, 100, taken=0), 5.3, 20.2, [(1e-3, 1e-3)], unstepped, 400) is None
               for step in (100, 200, 300))
    fallen = VerdictEngine()  # the same stillness once the loss fell 10x: steps below the weights' precision
    assert all(judge_progress(step, Drift(0.0, 5.0, 100), 1.5, 20.2, [(1e-3, 1e-3)], fallen, 400) is None
               for step in (100, 200, 300))
    early = VerdictEngine()  # checked every step: the first steps of any run leave the loss near its start
    assert all(judge_progress(step, frozen, 1.39, 1.40, [(1e-6, 1e-6)], early, 400) is None for step in range(1, 99))
    resumed = WeightDrift()  # a run resumed at step 500 has no reference loss: not judged
    assert resumed.reference(500, 1.39) is None and resumed.reference(600, 1.39) is None
    assert WeightDrift().reference(0, 1.40) == 1.40


def test_a_warm_up_the_run_cannot_finish_is_no_warm_ups_start() -> None:
    """A warm-up of 1e6 steps where 1e3 were meant leaves the learning rate near 0 for the whole run: under 10% of
    its base, as a warm-up's start is, but rising at a pace that reaches 4e-4 of it by the end. Its twins: a long
    warm-up that gets to 20% of its base by the run's end, and a decay's end (falling), stay exempt."""
    from lightning_debug.monitors.gradients.progress import Drift, judge_progress

    def drift(before: float) -> Drift:
        return Drift(moved=1e-7 * 100 * 5.0, size=5.0, steps=100, lrs_before=(before,))

    def judged(lrs: list[tuple[float, float]]) -> list[object]:
        engine = VerdictEngine()
        return [judge_progress(step, drift(lr - slope * 100), 1.39, 1.40, [(lr, base)], engine, 400)
                for step, (lr, base), slope in zip((100, 200, 300), lrs, (lrs[0][0] / 100,) * 3)]

    base = 0.05
    endless = judged([(base * step / 1e6, base) for step in (100, 200, 300)])
    assert endless[:2] == [None, None] and endless[2] is not None
    assert endless[2].finding.details["warm_up_reaches"] == pytest.approx(4e-4)
    assert "warm-up is far longer than the run" in endless[2].finding.message
    long_one = judged([(base * step / 2000, base) for step in (100, 200, 300)])  # 20% of its base at step 400
    assert long_one == [None, None, None]
    engine = VerdictEngine()  # a decay's end: falling under 10% of its base
    assert all(judge_progress(step, drift(0.004), 1.39, 1.40, [(0.002, base)], engine, 400) is None
               for step in (100, 200, 300))


def test_an_adam_eps_that_bounds_every_update_is_named_while_the_loss_has_not_halved() -> None:
    """``Adam(eps=1)`` over gradients of about 1e-3 divides every update by 1, not by the gradient's scale: the
    weights move 7e-5 of their size per step (above the 1e-5 of a too-small learning rate) and the loss stays above
    half of where it started. Its twins: the same eps on a loss that fell (TensorFlow's Inception recipe, eps=1 with a
    large learning rate), and an eps that bounds only half of the values, stay quiet."""
    from lightning_debug.monitors.gradients.progress import Drift, judge_progress

    def judged(bound: float, loss: float) -> list[object]:
        engine, drift = VerdictEngine(), Drift(7e-5 * 100 * 5.0, 5.0, 100, eps=1.0, eps_bound=bound)
        return [judge_progress(step, drift, loss, 1.40, [(1e-3, 1e-3)], engine, 400) for step in (100, 200, 300)]

    named = judged(1.0, 1.34)
    assert named[:2] == [None, None] and named[2] is not None
    assert (named[2].finding.details["eps"], named[2].finding.details["cause"]) == (1.0, "negligible_updates")
    assert "Adam's eps (1)" in named[2].finding.message
    assert judged(1.0, 1.05) != [None, None, None]  # 75% of its first loss: learning at a tenth of Adam's pace
    assert judged(1.0, 0.6) == [None, None, None]
    assert judged(0.5, 1.34) == [None, None, None]


def test_a_jump_waiting_at_a_checkpoint_is_decided_after_the_resume() -> None:
    """The watch's state travels with the checkpoint; the resumed run measures the steps after the jump
    over the index it builds again, and confirms the explosion where it began."""
    layer = nn.Linear(3, 1)
    (layer(torch.ones(2, 3)).sum() * 100).backward()
    index = ParameterIndex(list(layer.named_parameters()))
    before = Explosions(VerdictEngine())
    jump = Verdict(Finding(Kind.EXPLODING_GRAD, Severity.WARNING, "jump", {"limit": 10.0}), ["weight"])
    assert before.judge(12, None, 400.0, jump, True, {"step": 12}, index) == []
    state = before.verdicts.state_dict()  # the monitor's engine travels in its checkpoint
    assert [entry["first"]["step"] for entry in state["held"]] == [12]

    after = Explosions(VerdictEngine())
    after.verdicts.load_state_dict(state)
    after.resumed()
    assert after.measuring
    for step in (13, 14):
        after.measure(step, None, lambda: None, lambda optimizer: index)
    decided = after.read()
    assert [(step, verdict.finding.message, where) for step, verdict, where in decided] == [(12, "jump", {"step": 12})]
    assert not after.measuring


def test_a_spike_that_falls_back_at_once_is_dismissed() -> None:
    watch = ExplosionWatch()
    jump = Verdict(Finding(Kind.EXPLODING_GRAD, Severity.WARNING, "", {}))
    watch.suspect(17, jump, None, limit=16.6)
    # SwiftFormer's norms after its step-17 spike (37.8): back to 1.8, then two spikes in a row
    assert [watch.observe(step, norm) for step, norm in ((18, 1.81), (19, 25.5), (20, 42.9))] == [[], [], []]
    assert not watch
    assert watch.flush() == []


def test_a_replica_of_experts_that_wait_waits_longer_and_an_unused_layer_does_not() -> None:
    """Experts 0-2 are replicas (one group); expert 1 waits 6 steps for its first token, so expert 2 is not
    confirmed after the fixed window but only after more than twice that wait; the unused layer, replica of
    nothing conditional, is confirmed after the window as in any model."""
    history = MissingHistory()
    history.groups = {f"experts.{i}.w": [("experts", "w")] for i in range(3)}
    names = [*history.groups, "unused.w", "head.w"]
    history.set_called(dict.fromkeys(names, True), names)  # one window: every module ran without a graph
    history.observe_check(0, None, ["experts.1.w", "experts.2.w", "unused.w"], names)
    confirmed = {step: history.observe_step(step, ["experts.1.w"] if step >= 6 else [],
                                            ["experts.2.w", "unused.w"] + (["experts.1.w"] if step < 6 else []))
                 for step in range(1, 14)}
    assert history.longest_wait == 6 and confirmed[MISSING_CONFIRM_STEPS - 1] == ["unused.w"]
    assert [step for step, names in confirmed.items() if "experts.2.w" in names] == [WAIT_FACTOR * 6]
    assert history.confirm_the_rest() == []


def test_at_the_end_a_conditional_candidate_that_waited_less_than_twice_the_longest_wait_is_not_named() -> None:
    history = MissingHistory()
    history.groups = {f"experts.{i}.w": [("experts", "w")] for i in range(3)}
    history.observe_check(0, None, ["experts.1.w", "experts.2.w", "unused.w"], [*history.groups, "unused.w"])
    for step in range(1, 6):
        history.observe_step(step, ["experts.1.w"] if step == 5 else [], ["experts.2.w", "unused.w"]
                             + ([] if step == 5 else ["experts.1.w"]))
    resumed = MissingHistory()
    resumed.load_state_dict(history.state_dict())
    resumed.verdicts.load_state_dict(history.verdicts.state_dict())
    assert resumed.longest_wait == history.longest_wait == 5
    assert resumed.confirm_the_rest() == ["unused.w"]
    assert history.confirm_the_rest() == ["unused.w"]


def test_a_replica_going_without_a_gradient_between_checks_makes_a_lone_waiting_expert_wait_longer() -> None:
    """Checks every 100 steps: at step 0 only expert 2 has no gradient. Expert 0, watched with it, goes without
    one on steps 2-6 (a wait of 5), so expert 2 is confirmed only after more than twice that, not after the
    fixed window."""
    history = MissingHistory()
    history.set_groups({f"experts.{i}.w": [("experts", "w")] for i in range(3)})
    history.set_called(dict.fromkeys([*history.groups, "head.w"], True), list(history.groups))  # one window
    history.observe_check(0, None, ["experts.2.w"], [*history.groups, "head.w"])
    replicas = history.replicas_after_check(["experts.2.w"])  # as the monitor does
    assert replicas == ["experts.0.w", "experts.1.w"]
    idle = range(2, 7)
    confirmed = {step: history.observe_step(step, [r for r in replicas if step not in idle or r != "experts.0.w"],
                                            ["experts.2.w"] + (["experts.0.w"] if step in idle else []))
                 for step in range(1, 14)}
    assert history.longest_wait == 5 and history.replicas_to_watch() == []
    assert [step for step, names in confirmed.items() if names] == [WAIT_FACTOR * 5]


def test_replicas_that_get_their_gradient_every_step_leave_the_fixed_window() -> None:
    history = MissingHistory()
    history.set_groups({f"layers.{i}.w": [("layers", "w")] for i in range(3)})
    history.set_called(dict.fromkeys(history.groups, True), list(history.groups))  # one window
    history.observe_check(0, None, ["layers.2.w"], list(history.groups))
    replicas = history.replicas_after_check(["layers.2.w"])
    confirmed = [history.observe_step(step, replicas, ["layers.2.w"]) for step in range(1, MISSING_CONFIRM_STEPS)]
    assert confirmed[-1] == ["layers.2.w"], "a layer a stack never uses is named after the window"


def test_the_losses_of_the_recent_norms_travel_in_the_checkpoint() -> None:
    """A runaway below the window's height is judged by whether the loss fell with the norm: a resumed run must see
    the same losses."""
    from lightning_debug.monitors.gradients.exploding import runaway_level
    from lightning_debug.monitors.gradients.history import GradientHistory

    history = GradientHistory(["exploding_grad"])
    for norm, loss in ((4.4e4, 2.6), (0.35, 0.69), (0.0025, 0.69), (0.0029, 0.69)):
        history.recent_norms.add(norm, loss)
    resumed = GradientHistory(["exploding_grad"])
    resumed.load_state_dict(copy.deepcopy(history.state_dict()))
    assert list(resumed.recent_norms.losses) == list(history.recent_norms.losses)
    assert runaway_level(7720.0, resumed.recent_norms) == runaway_level(7720.0, history.recent_norms) == 0.0029


def test_a_variant_of_one_confirms_at_once_where_the_rest_of_its_kind_is_held() -> None:
    from lightning_debug.core.verdicts import policy_of

    policy = policy_of(Kind.LEARNING_STALLED)
    assert policy.holds and policy.needed("optimizer_not_stepping") == 1 and policy.needed("lr_zero") == 2
    engine = VerdictEngine()
    held = engine.observe(Kind.LEARNING_STALLED, 100, [Suspicion(Kind.LEARNING_STALLED, "lr_zero", 100,
                                                                 variant="lr_zero")])
    proof = engine.observe(Kind.LEARNING_STALLED, 100, [Suspicion(Kind.LEARNING_STALLED, "optimizer_not_stepping", 100,
                                                                  variant="optimizer_not_stepping")])
    assert held == [] and [c.first.key for c in proof] == ["optimizer_not_stepping"]


def test_unstepped_batches_are_judged_on_the_weights_and_a_learning_batch_starts_them_again() -> None:
    from lightning_debug.monitors.gradients.unstepped import JUDGE_AT, SAMPLE_AT, Unstepped, unstepped_verdict

    weights = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2), requires_grad=False)]
    optimizer = torch.optim.SGD(weights[:1], lr=0.0)  # lr 0: its steps leave the weights as they are
    watch = Unstepped()
    watch.watch([optimizer])
    for step in range(SAMPLE_AT + 5):  # a backward and an optimizer step: every batch learns
        watch.backward()
        optimizer.step()
        assert not watch.batch_ended(step, lambda: weights)
    assert watch.learned and watch.batches == 0 and watch.optimizer_steps == SAMPLE_AT + 5
    for batch in range(JUDGE_AT - 1):  # backwards and no step: the weights are sampled at SAMPLE_AT
        watch.backward()
        assert not watch.batch_ended(105, lambda: weights)
    watch.backward()
    assert watch.batch_ended(105, lambda: weights) and watch.backwards == JUDGE_AT
    verdict = unstepped_verdict(105, watch, VerdictEngine(), at_end=False)
    assert verdict is not None and verdict.finding.details["since_step"] == 105
    assert "opt.step()" in verdict.finding.message and "at optimizer step 105" in verdict.finding.message
    watch.release()
    optimizer.step()
    assert watch.optimizer_steps == SAMPLE_AT + 5

    unlearned = Unstepped()  # steps without a backward end before JUDGE_AT: judged at the end, on the weights
    unlearned.watch([optimizer])
    for step in range(SAMPLE_AT + 1):
        optimizer.step()
        unlearned.batch_ended(step, lambda: weights)
    assert unlearned.at_end(lambda: weights)
    ended = unstepped_verdict(SAMPLE_AT, unlearned, VerdictEngine(), at_end=True)
    assert ended is not None and "return loss" in ended.finding.message and "whole run" in ended.finding.message
    unlearned.release()
    moved = Unstepped()
    for step in range(SAMPLE_AT + 1):
        moved.batch_ended(0, lambda: weights)
    with torch.no_grad():
        weights[0].add_(1e-3)
    assert not moved.at_end(lambda: weights) and moved.cleared


def test_after_batches_that_learned_only_a_longer_run_of_unstepped_backwards_is_judged_at_the_end() -> None:
    """An optimizer that stops stepping is named at the end; forward-only batches after training (a statistics pass)
    and an accumulation the end cuts short, no longer than the run's own, are not, the weights unchanged alike."""
    from lightning_debug.monitors.gradients.unstepped import SAMPLE_AT, Unstepped

    weights = [nn.Parameter(torch.ones(4))]
    optimizer = torch.optim.SGD(weights, lr=0.0)  # its steps leave the weights as they are

    def run(accumulated: int, then: int, backward: bool) -> bool:
        watch = Unstepped()
        watch.watch([optimizer])
        for _ in range(3):  # three accumulations of `accumulated` batches, each ended by a step
            for batch in range(accumulated):
                watch.backward()
                if batch == accumulated - 1:
                    optimizer.step()
                watch.batch_ended(0, lambda: weights)
        for _ in range(then):
            if backward:
                watch.backward()
            watch.batch_ended(7, lambda: weights)
        watch.release()
        return watch.at_end(lambda: weights)

    assert run(1, SAMPLE_AT + 20, backward=True), "stopped stepping"
    assert not run(1, SAMPLE_AT + 20, backward=False), "forward only after training"
    assert not run(128, 112, backward=True), "an accumulation of 128 cut short at 112"
    assert run(60, 3 * 60, backward=True), "three times the run's accumulation"
