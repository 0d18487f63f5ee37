"""``frozen_param`` (``unregistered``): tensors the loss's backward reaches that are no parameter of the model and
that no optimizer holds, bit for bit the same :data:`SPACING` steps later.

Layers kept in a Python list or dict (``self.layers = [nn.Linear(...)]`` where ``nn.ModuleList`` is meant) and a
weight made with ``torch.randn(..., requires_grad=True)`` where ``nn.Parameter`` is meant take part in every forward
and get a gradient on every backward, yet ``self.parameters()`` does not list them: no optimizer holds them, so they
never train (nor does ``.to(device)`` move them or a checkpoint save them). The loss still falls on what the rest of
the model learns, and the run printed "No problems found". The model's own parameters are judged by the other causes
of ``frozen_param``. A leaf made anew on every step (WGAN-GP's interpolated inputs) is gone at the second look, and
one kept and updated by hand (free adversarial training's perturbation) has moved: both stay quiet. So
:class:`Unregistered` walks the graph of a check step's loss once
(:func:`~lightning_debug.checks.leaves.graph_leaves`) and keeps a sample of each leaf that is neither (a device copy,
no sync; none: the rule stops for good), then walks again on the first check step :data:`SPACING` steps later; the
leaves found both times with the same bits are named (one sync, once)::

    >>> from torch import nn
    >>> kept = [nn.Linear(3, 1)]
    >>> def loss(): return kept[0](torch.randn(8, 3)).sum()
    >>> watch = Unregistered()
    >>> watch.walk(0, loss(), known=set()), watch.walk(50, loss(), known=set())
    (None, None)
    >>> [tuple(t.shape) for t in watch.walk(100, loss(), known=set())]
    [(1, 3), (1,)]
    >>> updated = Unregistered()
    >>> _ = updated.walk(0, loss(), known=set())
    >>> with torch.no_grad(): _ = [p.add_(1.0) for p in kept[0].parameters()]
    >>> updated.walk(100, loss(), known=set())
    []
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from lightning_debug.checks.leaves import attribute_paths, graph_leaves
from lightning_debug.core.findings import Finding, quoted
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.progress import picked_parameters, weight_sample
from lightning_debug.monitors.gradients.trainability import FrozenCause
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict

SPACING = 100
"""Optimizer steps at least between the two looks at the graph: a hand-written update has moved a leaf by then."""


class Unregistered:
    """The leaves of the first walk that the model does not register and no optimizer holds, with their samples."""

    def __init__(self) -> None:
        self.walked_at: int | None = None
        self.done = False
        self._leaves: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = []

    def due(self, step: int) -> bool:
        """Whether the graph of ``step``'s loss is walked (the first check step, then one :data:`SPACING` on)."""
        return not self.done and (self.walked_at is None or step - self.walked_at >= SPACING)

    def walk(self, step: int, loss: torch.Tensor, known: set[int]) -> list[torch.Tensor] | None:
        """On a check step, the leaves of ``loss``'s graph whose ``id`` is not in ``known`` (the model's parameters and
        the optimizers') found unchanged since the first walk; None while there is nothing to say yet."""
        if not self.due(step):
            return None
        leaves = [t for t in graph_leaves(loss) if id(t) not in known and _readable(t)]
        if self.walked_at is None:
            picked = picked_parameters(leaves)
            self.walked_at, self.done = step, not picked
            self._leaves = [(weakref.ref(t), weight_sample([t])) for t in picked]
            return None
        self.done = True
        present = {id(t) for t in leaves}
        found = [(t, now, kept) for t, kept in ((ref(), kept) for ref, kept in self._leaves)
                 if t is not None and id(t) in present and (now := weight_sample([t])).shape == kept.shape]
        self._leaves = []
        if not found:
            return []
        unchanged = torch.stack([(now == kept).all() for _, now, kept in found]).tolist()
        return [t for (t, _, _), same in zip(found, unchanged) if same]


def _readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be sampled: a plain tensor whose storage holds them (a sharded strategy frees
    the storage of the gathered weights it put in the graph)."""
    try:
        return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.numel() > 0 and \
            tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return False


def unregistered_verdict(step: int, since: int, tensors: Sequence[torch.Tensor], model: nn.Module | None) -> Verdict:
    """``frozen_param`` (``unregistered``) for ``tensors``, named by where ``model`` keeps them."""
    paths = attribute_paths(model, tensors) if model is not None else {}
    order = {key: index for index, key in enumerate(paths)}
    tensors = sorted(tensors, key=lambda t: order.get(id(t), len(order)))
    names = [paths.get(id(t), f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}")
             for t in tensors]
    return Verdict(Finding(
        Kind.FROZEN_PARAM, Severity.WARNING,
        f"{len(names)} tensor(s) {quoted(names)} get a gradient on every backward but are no parameter of the model "
        f"and no optimizer holds them, so they never train: they are bit for bit the same at step {step} as at step "
        f"{since}. A layer kept in a Python list or dict is not registered: use nn.ModuleList or nn.ModuleDict; a "
        "learnable tensor needs nn.Parameter (not torch.tensor(..., requires_grad=True)). Unregistered, they are "
        "also not moved by .to(device) nor saved in checkpoints. If they are meant to stay fixed, "
        "requires_grad_(False) on them spares their gradient.",
        {"parameters": names[:NAMES_IN_DETAILS], "count": len(names), "cause": FrozenCause.UNREGISTERED.value,
         "since_step": since, "shapes": [list(t.shape) for t in tensors[:NAMES_IN_DETAILS]]}),
        names, FrozenCause.UNREGISTERED.value)


__all__ = ["SPACING", "Unregistered", "unregistered_verdict"]
