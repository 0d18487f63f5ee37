"""``vanishing_grad`` by a steady fade through depth (:mod:`lightning_debug.monitors.gradients.fade`), fed recorded
per-parameter norms: each narrowing beside the planted fade it must still name."""

from __future__ import annotations

from lightning_debug.core.kinds import Kind
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.fade import FADE_RATIO, judge_fade

DEPTH = 8


def grads(norms: list[float]) -> list[tuple[str, float]]:
    """``layers.N.weight`` and ``layers.N.bias`` per norm, the last one the ``head``."""
    names = [f"layers.{i}" for i in range(len(norms) - 1)] + ["head"]
    return [(f"{name}.{p}", norm / 2 ** 0.5) for name, norm in zip(names, norms) for p in ("weight", "bias")]


def dims(named: list[tuple[str, float]]) -> dict[str, int]:
    return {name: 2 if name.endswith("weight") else 1 for name, _ in named}


def sigmoid_fade(factor: float = 4.0) -> list[float]:
    """Eight sigmoid layers: each passes a quarter of the gradient back (the head 0.5)."""
    return [0.5 / factor ** (DEPTH - i) for i in range(DEPTH)] + [0.5]


def judged(series: list[list[float]]) -> list[object]:
    verdicts = VerdictEngine()
    return [judge_fade(100 * i, grads(norms), dims(grads(norms)), {}, "registration", verdicts)
            for i, norms in enumerate(series)]


def test_eight_sigmoid_layers_fade_under_the_ratio_without_a_layer_under_the_absolute_threshold() -> None:
    norms = sigmoid_fade()
    assert min(norms) > 1e-6 and norms[0] / norms[-1] < FADE_RATIO
    found = judged([norms] * 2)
    assert found[0] is None
    verdict = found[1]
    assert verdict is not None and verdict.finding.kind is Kind.VANISHING_GRAD and verdict.steps == [0, 100]
    assert verdict.finding.details["first_layer"] == "layers.0" and "`layers.0`" in verdict.finding.message


def test_a_healthy_network_and_a_fade_that_is_not_steady_are_quiet_but_a_lifted_first_layer_is_still_named() -> None:
    assert judged([[0.3, 0.5, 0.4, 0.6, 0.5, 0.7, 0.6, 0.8, 1.0]] * 4) == [None] * 4
    one_odd_layer = [1e-5] + [0.5] * DEPTH  # a single small first layer with the rest flat: not depth
    assert judged([one_odd_layer] * 4) == [None] * 4
    lora = [1e-5, 0.05] * 4 + [0.05]  # LoRA's A while B grows from 0, alternating with B: no trend through depth
    assert judged([lora] * 4) == [None] * 4
    attention = [0.2] + [1e-5, 1e-5, 0.1, 0.1, 0.3] * 2 + [0.5]  # query/key ~0 while attention is uniform
    assert judged([attention] * 4) == [None] * 4
    lifted = sigmoid_fade()
    lifted[0] = 1e-2  # Adam lifts the first layer over the ratio (8 tanh layers, small init); the next stay faded
    found = judged([sigmoid_fade(), lifted])
    assert found[1] is not None and found[1].steps == [0, 100]
    assert found[1].finding.details["first_layer"] == "layers.1"


def test_a_shallow_fade_and_exact_zeros_are_left_out_but_four_faded_layers_are_named() -> None:
    assert judged([[1e-6, 1e-5, 1e-4]] * 4) == [None] * 4  # three layers: not depth
    assert judged([[0.0] + sigmoid_fade()[1:]] * 4) == [None] * 4  # LoRA A while B is 0, a closed gate
    found = judged([[1e-6, 1e-5, 1e-4, 1e-2]] * 2)
    assert found[1] is not None and found[1].finding.details["ratio"] < FADE_RATIO


def test_a_fade_whose_first_layer_the_absolute_rule_holds_is_not_named_twice() -> None:
    verdicts = VerdictEngine()
    verdicts.observe(Kind.VANISHING_GRAD, 0, [Suspicion(Kind.VANISHING_GRAD, "layers.0", 0)])
    norms = grads(sigmoid_fade())
    assert [judge_fade(s, norms, dims(norms), {}, "", verdicts) for s in (0, 100, 200)] == [None] * 3


def test_one_small_layer_on_the_input_side_with_healthy_layers_around_it_is_no_fade() -> None:
    """ALBERT at random init (the sweep, every check every step): attention's query gets ~1e-4 of the head's
    gradient while the layers beside it on the input side get a normal share, and the norms still rise towards
    the output. A fade shrinks the whole input side: its median must be under the ratio too."""
    norms = [0.05, 3e-5, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.5]
    assert norms[1] / norms[-1] < FADE_RATIO
    assert judged([norms] * 3) == [None, None, None]
    faded = [1e-5, 3e-5, 8e-5, 2e-4, 0.05, 0.08, 0.1, 0.2, 0.5]  # the same ends, the whole input side faded
    assert judged([faded] * 2)[1] is not None


# Recorded from ModernVBERT (tiny config, the sweep's 300 steps, every check every step, the loss 5.55 -> 0.87): the
# two transformer layers' weights all near 4e-4, behind a projection head and an lm_head 300x larger.
MODERNBERT = [3.1e-4, 5.1e-4, 5.0e-4, 5.8e-4, 3.3e-4, 5.4e-4, 5.4e-4, 6.0e-4, 0.186, 0.798]


def test_one_cliff_between_flat_layers_is_no_fade_but_the_same_cliff_over_a_fading_body_is() -> None:
    assert MODERNBERT[0] / MODERNBERT[-1] < FADE_RATIO
    assert judged([MODERNBERT] * 4) == [None] * 4
    fading_body = [3e-6, 1e-5, 3e-5, 1e-4, 2e-4, 3e-4, 4e-4, 6e-4, 0.186, 0.798]  # the same cliff, a body fading 200x
    found = judged([fading_body] * 2)
    assert found[1] is not None and found[1].finding.details["first_layer"] == "layers.0"
