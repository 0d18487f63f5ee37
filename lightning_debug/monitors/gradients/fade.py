"""``vanishing_grad`` by a steady fade through depth: the first layer's gradient a thousandth of the last's.

Eight sigmoid layers lose the signal 4x per layer: every layer stays above ``gradient_vanishing_threshold`` and no
two neighbours differ much, so the absolute rule (:mod:`.vanishing`) never fires, yet the input side does not
learn. AutoTrainer's criterion (ICSE 2021) is the ratio of the first layer's gradient norm to the last's, under
:data:`FADE_RATIO`; healthy models stay far above it (0.13 to 1.5 on the fault benchmark's twins). The layers are
the modules owning a weight (2+ dimensions) in forward order; the "first layer" is the smallest of the input half
(Adam can lift the very first layer back while those after it stay faded), and the fade must be steady from there
to the output (:data:`STEADY_CORRELATION`), so attention's query and key, ~1e-5 of the head's on a healthy BERT
between feed-forward layers that are not, are no fade. Nor is one cliff between flat layers: what is left of the
fade once its largest step between two neighbouring layers is taken out must still be under :data:`SPREAD_RATIO`
(ModernBERT's two layers all near 4e-4 behind a projection head 300x larger, while the loss falls 6x, is a step of
scale at one boundary, not depth). docs/gradients.md lists the other exclusions. Held under
``vanishing_grad``'s ``fade`` variant in a scope of its own::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> norms = [("l0.weight", 1e-6), ("l1.weight", 1e-5), ("l2.weight", 1e-4), ("l3.weight", 1e-3),
    ...          ("head.weight", 0.3)]
    >>> verdicts, dims = VerdictEngine(), dict.fromkeys([n for n, _ in norms], 2)
    >>> judge_fade(0, norms, dims, {}, "registration", verdicts) is None
    True
    >>> verdict = judge_fade(100, norms, dims, {}, "registration", verdicts)
    >>> verdict.finding.kind.value, verdict.steps, f"{verdict.finding.details['ratio']:.2g}"
    ('vanishing_grad', [0, 100], '3.3e-06')
    >>> healthy = [(name, 0.1 * (i + 1)) for i, (name, _) in enumerate(norms)]
    >>> judge_fade(300, healthy, dims, {}, "registration", VerdictEngine()) is None
    True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.layout import Positions, module_of
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict

FADE_RATIO = 1e-3
STEADY_CORRELATION = 0.8
SPREAD_RATIO = 1e-2
MIN_LAYERS = 4
SCOPE = FADE = "fade"


def weighted_layers(grads: Sequence[tuple[str, float]], dims: Mapping[str, int],
                    positions: Positions) -> list[tuple[str, float]]:
    """``(module, gradient norm)`` of the modules owning a parameter of two or more dimensions, in forward order
    (modules whose position is unknown are left out: their place in depth is not known)."""
    squares: dict[str, float] = {}
    weighted: dict[str, None] = {}  # in the order given, for registration order without positions
    place: dict[str, tuple[int, int]] = {}
    for name, norm in grads:
        module = module_of(name)
        squares[module] = squares.get(module, 0.0) + norm * norm
        if dims.get(name, 0) >= 2:
            weighted[module] = None
        if name in positions:
            place[module] = min(place.get(module, positions[name]), positions[name])
    known = [module for module in weighted if module in place or not positions]
    known.sort(key=lambda module: place.get(module, (0, 0)))
    return [(module, math.sqrt(squares[module])) for module in known]


def judge_fade(step: int, grads: Sequence[tuple[str, float]], dims: Mapping[str, int], positions: Positions,
               order_source: str, verdicts: VerdictEngine) -> Verdict | None:
    """The ``vanishing_grad`` finding of a steady fade confirmed at this check step, or None (see the module)."""
    layers = weighted_layers(grads, dims, positions)
    suspicions = []
    if len(layers) >= MIN_LAYERS:
        norms = [norm for _, norm in layers]
        deepest = input_side(norms)
        low, (last, high) = norms[deepest], layers[-1]
        if (all(math.isfinite(n) for n in norms) and 0 < low < FADE_RATIO * high
                and statistics.median(norms[:max(1, len(norms) // 2)]) < FADE_RATIO * high
                and verdicts.hold(Kind.VANISHING_GRAD, layers[deepest][0]) is None
                and len(norms) - deepest >= MIN_LAYERS and rank_correlation(norms[deepest:]) >= STEADY_CORRELATION
                and without_largest_step(norms[deepest:]) < SPREAD_RATIO):
            suspicions.append(Suspicion(Kind.VANISHING_GRAD, layers[0][0], step, value=low / high, variant=FADE,
                                        measured={"last": last}))
    confirmed = verdicts.observe(Kind.VANISHING_GRAD, step, suspicions, scope=SCOPE)
    if not confirmed:
        return None
    held = confirmed[0]
    first = layers[input_side([norm for _, norm in layers])][0]
    finding = fade_finding(step, layers, first, order_source, held.first.step)
    steps = held.steps if len(held.steps) > 1 else []
    return Verdict(finding, [name for name, _ in grads if module_of(name) == first], steps=steps, key=held.key)


def input_side(norms: Sequence[float]) -> int:
    """The index of the smallest norm of the input half (the hold's key is the first layer all the same, so a
    minimum that moves between neighbours does not restart it)."""
    half = norms[:max(1, len(norms) // 2)]
    return half.index(min(half))


def without_largest_step(norms: Sequence[float]) -> float:
    """The ratio of the first norm to the last with the largest growth between two neighbours taken out::

        >>> without_largest_step([1e-4, 1e-3, 1e-2, 1.0]), without_largest_step([3e-4, 5e-4, 6e-4, 0.2, 0.8])
        (0.01, 0.125)
    """
    largest = max((after / before for before, after in zip(norms, norms[1:]) if before > 0), default=1.0)
    return norms[0] / norms[-1] * max(1.0, largest)


def rank_correlation(values: Sequence[float]) -> float:
    """Spearman's correlation of ``values`` with their order (1: strictly growing; tied values share their mean
    rank, so a flat run adds no trend; 0 when every value is the same)::

        >>> rank_correlation([1e-6, 1e-5, 1e-4, 1e-3]), round(rank_correlation([1e-5, 0.3, 1e-5, 0.3, 1e-5, 0.3]), 2)
        (1.0, 0.29)
    """
    n = len(values)
    order = sorted(range(n), key=lambda i: values[i])
    ranks = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2
        start = end + 1
    mean = (n - 1) / 2
    covariance = sum((rank - mean) * (index - mean) for index, rank in enumerate(ranks))
    spread = math.sqrt(sum((rank - mean) ** 2 for rank in ranks) * sum((i - mean) ** 2 for i in range(n)))
    return covariance / spread if spread > 0 else 0.0


def fade_finding(step: int, layers: Sequence[tuple[str, float]], first: str, order_source: str,
                 since: int) -> Finding:
    norms = dict(layers)
    low, (last, high) = norms[first], layers[-1]
    ratio = low / high
    depth = [module for module, _ in layers].index(first)
    per_layer = ratio ** (1 / max(1, len(layers) - 1 - depth))
    shown = ", ".join(f"`{m or '(root)'}` {n:.3g}" for m, n in layers[:NAMES_IN_DETAILS])
    details: dict[str, Any] = {
        "layers": [first], "first_layer": first, "last_layer": last, "ratio": ratio, "threshold": FADE_RATIO,
        "per_layer_factor": per_layer, "since_step": since, "order": order_source,
        "layer_norms": dict(layers[:NAMES_IN_DETAILS]), "rule": "fade"}
    return Finding(
        Kind.VANISHING_GRAD, Severity.WARNING,
        f"The gradient fades steadily through depth: the input-side layer `{first or '(root)'}` gets {ratio:.2g} of "
        "the "
        f"gradient norm of the last layer `{last or '(root)'}` ({low:.3g} vs {high:.3g}, about {per_layer:.2g}x per "
        f"layer over {len(layers) - depth} layers) at step {step}, on every check step since step {since}; under "
        f"{FADE_RATIO:g}, the layers near the input barely learn. In forward order: {shown}. Saturating "
        "activations (sigmoid/tanh) or too small an initialisation shrink the gradient at every layer: prefer "
        "ReLU/GELU, Kaiming/Xavier initialisation, normalisation layers or residual connections.",
        details)
