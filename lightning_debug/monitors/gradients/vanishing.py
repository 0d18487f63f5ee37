"""``vanishing_grad``: the gradient signal dies on its way back toward the input, and stays so.

One low norm fires on healthy models (a LoRA A while B = 0, ConvNeXt's layer scale, uniform attention), where the
gradient is healthy again on the input side or grows within a step or two. So a layer is *low* when it has not grown
:data:`VANISHING_GROWTH` times over its first norm, and a run of low layers vanishes when it reaches the input side
with a layer after it :data:`VANISHING_DROP` times larger, or is exactly zero (held longer: a straight-through
router is zero on some steps). A layer that started above the threshold is not low once the loss fell
:data:`CONVERGED_FALL` times below the run's first: its gradient shrank because the model learned (BEiT's class
token, which mean pooling barely reads, under 1e-6 once the loss is 1/170 of its start), while a gradient that is
exactly zero, or low from the start, is judged all the same. docs/gradients.md gives the cases::

    >>> history, verdicts = VanishingHistory(), VerdictEngine()
    >>> grads = [("a.weight", 1e-9), ("b.weight", 0.5)]
    >>> [judge_vanishing(s, grads, GradientSettings(), {}, "registration", history, verdicts) is None
    ...  for s in (0, 1, 2)]
    [True, True, False]
    >>> history, verdicts = VanishingHistory(), VerdictEngine()
    >>> waking = [[("a.weight", 0.0), ("b.weight", 0.5)], [("a.weight", 1e-7), ("b.weight", 0.5)]]
    >>> judge_vanishing(0, waking[0], GradientSettings(), {}, "", history, verdicts) is None
    True
    >>> verdicts.held_keys(Kind.VANISHING_GRAD)
    ['a']
    >>> verdict = judge_vanishing(1, waking[1], GradientSettings(), {}, "", history, verdicts)
    >>> verdict, verdicts.held_keys(Kind.VANISHING_GRAD)
    (None, [])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import ConfirmedBy, Suspicion, VerdictEngine, policy_of
from lightning_debug.monitors.gradients.layout import Positions, input_to_output, module_of
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict
from lightning_debug.monitors.gradients.weight_decay import decay_advice

VANISHING_DROP = 1e3
VANISHING_GROWTH = 100.0
CONVERGED_FALL = 10.0
EXACTLY_ZERO = "exactly_zero"
"""The variant of a vanishing suspicion whose layers are all exactly zero (its policy waits longer)."""
FLAT_LOSS = "flat_loss"
"""The variant of every layer of the model exactly zero while the loss is finite and not 0: the loss is flat in the
model's output (a ``round`` or ``argmax`` on the way), which no healthy step shows for the whole model at once."""
VANISHING_DEAD_CHECKS = policy_of(Kind.VANISHING_GRAD).needed(EXACTLY_ZERO) or 1


class VanishingHistory:
    """Each layer's first gradient norm: the baseline a low layer must not have grown from."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"first": dict(self.first)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first = {k: float(v) for k, v in state.get("first", {}).items()}


def layer_norms(grads: Sequence[tuple[str, float]]) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The gradient norm of each layer (module: the parameters it owns directly) and its parameters."""
    members: dict[str, list[str]] = {}
    squares: dict[str, float] = {}
    for name, norm in grads:
        module = module_of(name)
        members.setdefault(module, []).append(name)
        squares[module] = squares.get(module, 0.0) + norm * norm
    return {module: math.sqrt(value) for module, value in squares.items()}, members


def vanishing_layers(module_norms: dict[str, float], members: dict[str, list[str]], low: float,
                     positions: Positions, first: dict[str, float], converged: bool = False) -> dict[str, str]:
    """The layers of this check step in vanishing runs (see the module's docstring), input side first,
    with the variant of their suspicion (:data:`EXACTLY_ZERO` for a dead run away from the input side)::

        >>> norms = {"stem": 1e-12, "block": 1e-9, "head": 1e-2, "q": 2e-7, "v": 4e-5, "gate": 0.0, "out": 0.1}
        >>> members = {m: [m + ".w"] for m in norms}
        >>> vanishing_layers(norms, members, 1e-6, {}, {})
        {'stem': '', 'block': '', 'gate': 'exactly_zero'}
        >>> vanishing_layers(norms, members, 1e-6, {}, {"stem": 1e-2, "gate": 1e-2}, converged=True)
        {'gate': 'exactly_zero'}
    """
    fallback = (len(positions) + 1, 0)
    order = sorted(module_norms, key=lambda m: min(positions.get(name, fallback) for name in members[m]))
    is_low = [math.isfinite(module_norms[m]) and module_norms[m] < low
              and module_norms[m] <= VANISHING_GROWTH * first.get(m, module_norms[m])
              and not (converged and module_norms[m] > 0 and first.get(m, 0.0) >= low) for m in order]
    found: dict[str, str] = {}
    start = 0
    while start < len(order):
        if not is_low[start]:
            start += 1
            continue
        end = start
        while end < len(order) and is_low[end]:
            end += 1
        run = order[start:end]
        after = module_norms[order[end]] if end < len(order) else math.nan
        smallest = min(module_norms[m] for m in run)
        if start == 0 and smallest * VANISHING_DROP <= after:
            found.update(dict.fromkeys(run, ""))
        elif all(module_norms[m] == 0 for m in run):
            found.update(dict.fromkeys(run, EXACTLY_ZERO))
        start = end
    return found


def judge_vanishing(step: int, grads: Sequence[tuple[str, float]], settings: GradientSettings,
                    positions: Positions, order_source: str, history: VanishingHistory, verdicts: VerdictEngine,
                    loss: float = math.nan, first_loss: float = math.nan, decay: float = 0.0) -> Verdict | None:
    """The ``vanishing_grad`` finding of a check step, or None. ``grads``: every parameter's norm, or nothing when
    none was read (every hold ends); ``first_loss``: the run's first finite loss, which a converged run fell
    :data:`CONVERGED_FALL` times below; ``decay``: the share of a weight weight decay takes per step, named first in
    the advice when strong (:func:`~lightning_debug.monitors.gradients.weight_decay.decay_advice`). Judged per
    module, so a parameter exactly zero while its module learns (attention's key bias) is no dead layer. A check whose
    loss is 0 with every gradient 0 (a margin loss that holds) is not judged."""
    if loss == 0 and grads and all(norm == 0 for _, norm in grads):
        return None
    low = settings.vanishing_threshold
    module_norms, members = layer_norms(grads)
    for module, norm in module_norms.items():
        if math.isfinite(norm):
            history.first.setdefault(module, norm)
    converged = 0 <= loss * CONVERGED_FALL < first_loss
    dying = vanishing_layers(module_norms, members, low, positions, history.first, converged)
    if module_norms and math.isfinite(loss) and all(norm == 0 for norm in module_norms.values()):
        dying = dict.fromkeys(dying, FLAT_LOSS)
    confirmed = verdicts.observe(Kind.VANISHING_GRAD, step, [Suspicion(Kind.VANISHING_GRAD, module, step,
                                                                       variant=variant)
                                                             for module, variant in dying.items()])
    if not confirmed:
        return None
    layers = {c.key for c in confirmed}
    below = [n for m in dying if m in layers for n in members[m]]
    since = min(c.first.step for c in confirmed)
    finding = vanishing_finding(step, grads, below, module_norms, low, positions, order_source, since, loss, decay)
    policy = policy_of(Kind.VANISHING_GRAD)
    finding.details.update(since_step=since,
                           confirm_checks=max(policy.needed(c.latest.variant) or 1 for c in confirmed))
    backdated = sorted({at for c in confirmed if c.by is not ConfirmedBy.AGAIN for at in c.steps})
    return Verdict(finding, below, steps=backdated if backdated and backdated != [step] else [])


def vanishing_finding(step: int, grads: Sequence[tuple[str, float]], below: list[str],
                      module_norms: dict[str, float], low: float, positions: Positions,
                      order_source: str, since: int | None = None, loss: float = math.nan,
                      decay: float = 0.0) -> Finding:
    """The finding for the parameters ``below``, input side first, with their neighbouring layers."""
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
    streak = (f", as on every check step since step {since}, without growing" if since is not None and since != step
              else "")
    compared = (f" (neighbouring layers: {', '.join(f'{label(n)} {v:.3g}' for n, v in around)})"
                if around else "")
    where_it_dies = (f"; gradients are healthy again from `{healthy_after}` on, so the signal dies on its way back "
                     "toward the input" if healthy_after else "")
    if len(dead) == len(all_layers) and math.isfinite(loss):
        cause = (f"Every gradient of the model is exactly zero while the loss is {loss:.4g}: the loss is flat in the "
                 "model's output, so nothing flows back at all. Look for a step between the output and the loss "
                 "that has no gradient (round, argmax, a comparison, a hard threshold, a clamp that saturates) "
                 "or an output layer whose inputs are all zero (dead ReLUs before it).")
    elif dead and len(dead) == len(layers):
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
        f"{low:g} at step {step}{streak}, input side first: {', '.join(label(n) for n in layers[:WORST_SHOWN])}"
        f"{f' and {len(layers) - WORST_SHOWN} more' if len(layers) > WORST_SHOWN else ''}; {label(first)} "
        f"{module_norms[first]:.3g}{compared}{where_it_dies}. {' '.join(filter(None, (decay_advice(decay), cause)))}",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(below), "layers": layers[:NAMES_IN_DETAILS],
         "layer_norms": {layer: module_norms[layer] for layer in layers[:NAMES_IN_DETAILS]},
         "neighbours": {layer: neighbours(layer) for layer in layers[:NAMES_IN_DETAILS]},
         "norms": {name: norms[name] for name in ordered[:NAMES_IN_DETAILS]},
         "threshold": low, "healthy_from": healthy_after,
         "exactly_zero": [name for name in ordered if norms[name] == 0][:NAMES_IN_DETAILS],
         "dead_layers": dead[:NAMES_IN_DETAILS], "order": order_source})
