"""``vanishing_grad``: layers whose gradients have (nearly) stopped flowing back.

Example::

    >>> grads = [("a.weight", 1e-9), ("a.bias", 0.0), ("b.weight", 0.5)]
    >>> verdict = judge_vanishing(3, grads, GradientSettings(), {}, "registration order")
    >>> verdict.finding.details["layers"], verdict.finding.details["layer_norms"]
    (['a'], {'a': 1e-09})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.layout import Positions, input_to_output, module_of
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict


def judge_vanishing(step: int, grads: Sequence[tuple[str, float]], settings: GradientSettings,
                    positions: Positions, order_source: str) -> Verdict | None:
    """Vanishing gradients, judged per layer (module): the norm of all of a module's gradients below
    ``gradient_vanishing_threshold``.

    A parameter whose gradient is exactly zero while the rest of its module learns is structural
    (the key bias of attention: softmax ignores a shift shared by every key), which would make a
    per-parameter rule fire on a healthy model: judging the module's norm rules it out; a whole
    module at zero is a dead layer.
    """
    low = settings.vanishing_threshold
    members: dict[str, list[str]] = {}
    squares: dict[str, float] = {}
    for name, norm in grads:
        module = module_of(name)
        members.setdefault(module, []).append(name)
        squares[module] = squares.get(module, 0.0) + norm * norm
    module_norms = {module: math.sqrt(value) for module, value in squares.items()}
    dying = [module for module, norm in module_norms.items() if math.isfinite(norm) and norm < low]
    if not dying:
        return None
    below = [n for m in dying for n in members[m]]
    return Verdict(vanishing_finding(step, grads, below, module_norms, low, positions, order_source), below)


def vanishing_finding(step: int, grads: Sequence[tuple[str, float]], below: list[str],
                      module_norms: dict[str, float], low: float, positions: Positions,
                      order_source: str) -> Finding:
    """The finding for the parameters ``below`` (of vanishing layers), input side first, compared with
    their neighbouring layers, with advice that fits whether they are exactly zero."""
    norms = dict(grads)
    ordered = input_to_output(below, positions)
    everything = input_to_output((name for name, _ in grads), positions)
    position = {name: index for index, name in enumerate(everything)}
    last_vanishing = max(position[name] for name in below)
    healthy_after = everything[last_vanishing + 1] if last_vanishing + 1 < len(everything) else None
    layers = list(dict.fromkeys(module_of(name) for name in ordered))
    all_layers = list(dict.fromkeys(module_of(name) for name in everything))
    dead = [layer for layer in layers if module_norms[layer] == 0]

    def label(layer: str) -> str:
        return f"`{layer or '(root)'}`"

    def neighbours(layer: str) -> list[list[Any]]:
        index = all_layers.index(layer)
        near = [all_layers[i] for i in (index - 1, index + 1) if 0 <= i < len(all_layers)]
        return [[other, module_norms[other]] for other in near if not module_norms[other] < low]

    first = layers[0]
    around = neighbours(first)
    compared = (f" (neighbouring layers: {', '.join(f'{label(n)} {v:.3g}' for n, v in around)})"
                if around else "")
    where_it_dies = (f"; gradients are healthy again from `{healthy_after}` on, so the signal dies on its way back "
                     "toward the input" if healthy_after else "")
    if dead and len(dead) == len(layers):
        cause = ("Their gradients are exactly zero: nothing flows back into them. Look for a layer downstream "
                 "whose weights are all zero, dead ReLUs (pre-activations all negative, often after a too-large "
                 "step), a mask or a detach()/no_grad() on the path, or a constant output.")
    else:
        cause = ("Use ReLU/GELU instead of saturating sigmoid/tanh, a better initialization (Kaiming/Xavier), "
                 "normalization layers or residual connections, and look for a detach() or no_grad() on the path."
                 + (f" {len(dead)} of these layers are exactly zero (dead ReLUs, a masked path or zero weights "
                    "downstream)." if dead else ""))
    return Finding(
        Kind.VANISHING_GRAD, Severity.WARNING,
        f"{len(layers)} of {len(all_layers)} layers have a gradient norm below gradient_vanishing_threshold "
        f"{low:g} at step {step}, input side first: {', '.join(label(n) for n in layers[:WORST_SHOWN])}"
        f"{f' and {len(layers) - WORST_SHOWN} more' if len(layers) > WORST_SHOWN else ''}; {label(first)} "
        f"{module_norms[first]:.3g}{compared}{where_it_dies}. {cause}",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(below), "layers": layers[:NAMES_IN_DETAILS],
         "layer_norms": {layer: module_norms[layer] for layer in layers[:NAMES_IN_DETAILS]},
         "neighbours": {layer: neighbours(layer) for layer in layers[:NAMES_IN_DETAILS]},
         "norms": {name: norms[name] for name in ordered[:NAMES_IN_DETAILS]},
         "threshold": low, "healthy_from": healthy_after,
         "exactly_zero": [name for name in ordered if norms[name] == 0][:NAMES_IN_DETAILS],
         "dead_layers": dead[:NAMES_IN_DETAILS], "order": order_source})
