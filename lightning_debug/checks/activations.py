"""Statistics of a layer's output: what ``log_activations`` measures on a check step, as device tensors the
monitor stacks for all modules of a forward pass and reads once, a step later.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.numerics import compiled_wrapper

STATS = ("mean", "std", "max_abs", "zero_fraction", "saturated_fraction", "nonfinite_count")
ROW = STATS + ("dead_unit_fraction", "zero_row_fraction")
"""What :func:`output_stats` measures: the logged :data:`STATS`, then what only the rules read."""
MIN_SAMPLES = 8
SATURATION_MARGIN = 0.02
RELU_LIKE = (nn.ReLU, nn.ReLU6)
_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


RECTIFIER_NODES = ("ReluBackward", "ThresholdBackward", "ClampMinBackward", "ClampBackward", "HardtanhBackward")
"""The autograd nodes of the operations that clamp at 0 (``F.relu``, ``F.threshold``, ``clamp(min=0)``,
``F.relu6``), written in a ``forward``: where no module is there to tell, the operation is."""


def rectified(output: torch.Tensor) -> bool:
    """Whether ``output`` was made by an operation that clamps at 0, as a ReLU module's output is (the model's
    output written in ``forward`` as ``F.relu(self.head(x))``)::

        >>> z = torch.randn(4, 3, requires_grad=True)
        >>> rectified(torch.relu(z)), rectified(z.clamp_min(0)), rectified(torch.sigmoid(z)), rectified(z.detach())
        (True, True, False, False)
    """
    return type(output.grad_fn).__name__.startswith(RECTIFIER_NODES)


AFFINE_NODES = ("AddmmBackward", "MmBackward", "LinearBackward", "ConvolutionBackward", "BmmBackward",
                "BaddbmmBackward", "AddmvBackward", "MvBackward")
"""The autograd nodes of affine maps (``nn.Linear``, ``@``, convolutions): an output they make is unbounded."""
VIEW_NODES = ("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "SqueezeBackward", "UnsqueezeBackward",
              "SelectBackward", "SliceBackward", "PermuteBackward", "TransposeBackward", "TBackward", "ExpandBackward",
              "CloneBackward", "AliasBackward", "AsStridedBackward", "ToCopyBackward")
"""Operations that move or copy values without changing them, looked through to the one that made them."""


def made_by_affine(output: torch.Tensor, limit: int = 8) -> bool:
    """Whether ``output``'s values were made by an affine map (looked through up to ``limit`` reshapes, slices and
    casts): logits, which no bound holds, even on a batch where they all happen to lie in [0, 1] (a GAN's
    discriminator near its equilibrium)::

        >>> layer, x = nn.Linear(4, 1), torch.randn(3, 4)
        >>> made_by_affine(layer(x).squeeze(-1)), made_by_affine(torch.sigmoid(layer(x))), made_by_affine(x)
        (True, False, False)
    """
    node = output.grad_fn
    for _ in range(limit):
        name = type(node).__name__
        if name.startswith(AFFINE_NODES):
            return True
        if node is None or not name.startswith(VIEW_NODES) or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def saturation_range(module: nn.Module) -> tuple[float, float] | None:
    """``(center, half_width)`` of a bounded activation's output range, or None for other modules.

    >>> saturation_range(nn.Sigmoid()), saturation_range(nn.Hardtanh(-2.0, 2.0)), saturation_range(nn.ReLU())
    ((0.5, 0.5), (0.0, 2.0), None)
    """
    if isinstance(module, (nn.Sigmoid, nn.Hardsigmoid)):
        return 0.5, 0.5
    if isinstance(module, (nn.Tanh, nn.Softsign)):
        return 0.0, 1.0
    if isinstance(module, nn.Hardtanh) and not isinstance(module, nn.ReLU6):
        return (module.min_val + module.max_val) / 2, (module.max_val - module.min_val) / 2
    return None


def output_stats(output: torch.Tensor, saturation: tuple[float, float] | None = None,
                 units: bool = False) -> torch.Tensor:
    """One float32 row of :data:`ROW` for a module's output, on its device (no host sync): ``zero_fraction`` counts
    exact zeros (a ReLU's inactive units), ``saturated_fraction`` values within 2% of the half-width from the ends of
    ``saturation`` (NaN without it); the std comes from float32 sums (enough to watch a layer). With ``units``,
    ``dead_unit_fraction`` is the share of the last dimension's units zero for every sample and ``zero_row_fraction``
    the share of samples (rows of the last dimension) zero in every unit, through which no gradient flows (from
    :data:`MIN_SAMPLES` samples on).

    >>> row = output_stats(torch.tensor([0.0, 0.0, 1.0, 3.0]))
    >>> [round(v, 3) for v in row.tolist()[:4]], row[4].isnan().item(), row[5].item()
    ([1.0, 1.225, 3.0, 0.5], True, 0.0)
    >>> round(output_stats(torch.tensor([0.001, 0.5, 0.999]), saturation=(0.5, 0.5))[4].item(), 4)
    0.6667
    >>> output_stats(torch.ones(8, 4) * torch.tensor([1.0, 2.0, 3.0, 0.0]), units=True)[6:].tolist()
    [0.25, 0.0]
    """
    x = output.detach()
    count = x.numel()
    if count == 0:
        return torch.full((len(ROW),), math.nan, dtype=torch.float32, device=x.device)
    # a handful of single-pass reductions (var_mean and inf-norms cost several times more on CPU)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # vector_norm will not narrow a double
    total = x.sum(dtype=wide)
    squares = torch.linalg.vector_norm(x, dtype=wide).square()
    low, high = torch.aminmax(x)
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(0).sqrt()
    max_abs = torch.maximum(-low, high).float()
    zeros = count - torch.count_nonzero(x)
    nonfinite = torch.count_nonzero(x - x)  # x - x is 0, or NaN where x is NaN/Inf
    if saturation is not None:
        center, half = saturation
        saturated = ((x - center).abs() >= half * (1 - SATURATION_MARGIN)).sum() / count
    else:
        saturated = torch.full((), math.nan, device=x.device)
    width = x.shape[-1] if x.dim() >= 2 else 0
    if units and width and count // width >= MIN_SAMPLES:
        active = x.reshape(-1, width).ne(0)
        dead = (width - torch.count_nonzero(active.any(0))) / width
        zero_rows = 1 - torch.count_nonzero(active.any(1)) / (count // width)
    else:
        dead = zero_rows = torch.full((), math.nan, device=x.device)
    return torch.stack([mean.float(), std.float(), max_abs, (zeros / count).float(), saturated.float(),
                        nonfinite.float(), dead.float(), zero_rows.float()])


DEAD_PUSHED = ("dead_units_pushed",)
PUSH_TOLERANCE = 1e-3


def dead_units_pushed(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """How many of the last dimension's units of ``output`` that are zero for every sample the loss asks to rise
    (a gradient below zero at one sample at least, beyond ``PUSH_TOLERANCE`` of the largest): the clamp at 0 holds
    them there. A unit whose target is 0 (an autoencoder's blank border pixel) sits where the loss wants it, and
    its gradient is 0; a class whose ReLU logit is stuck at 0 gets ``p - 1 < 0`` from each of its samples::

        >>> output = torch.tensor([[0.0, 0.0, 1.0]] * 8)
        >>> dead_units_pushed(torch.tensor([[-0.1, 0.0, 0.2]] * 8), output).item()
        1.0
        >>> dead_units_pushed(torch.zeros(8, 3), output).item(), dead_units_pushed(torch.zeros(2, 3), output[:2]).item()
        (0.0, nan)
    """
    width = output.shape[-1] if output.dim() >= 2 else 0
    if not width or output.numel() // width < MIN_SAMPLES:
        return torch.full((), math.nan, device=output.device)
    g = grad.detach().reshape(-1, width).float()
    dead = output.detach().reshape(-1, width).eq(0).all(0)
    pushed = g.lt(-PUSH_TOLERANCE * g.abs().amax()).any(0)
    return (dead & pushed).sum().float()


def hooked_modules(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The modules the activation hooks observe, by name, in one walk: the leaves, whose outputs are the layers'
    activations (a ``torch.compile`` wrapper is one leaf, observed from outside, see
    :func:`~lightning_debug.checks.numerics.compiled_wrapper`), and the modules with children outside such a wrapper
    (the model itself as ``""``), whose return is the model's output when it is computed after the last layer (a
    softmax written in ``forward``).

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    >>> [[name for name, _ in group] for group in hooked_modules(model)]
    [['0', '1.0', '1.1'], ['', '1']]
    """
    leaves: list[tuple[str, nn.Module]] = []
    containers: list[tuple[str, nn.Module]] = []
    compiled: list[str] = []
    for name, module in model.named_modules():
        if any(not prefix or name.startswith(prefix + ".") for prefix in compiled):
            continue
        if compiled_wrapper(module):
            compiled.append(name)
            leaves.append((name, module))
        elif next(module.children(), None) is None:
            leaves.append((name, module))
        else:
            containers.append((name, module))
    return leaves, containers


GRAPH_NODES = 512
"""How many autograd nodes :func:`gives_loss` walks before it answers "unknown" (a healthy model's output is a few
nodes from its loss: the loss function, a reshape, a cast)."""
WEIGHT_CHAIN = 4


def _weight_input(node: Any) -> bool:
    """Whether an autograd node is a layer's weight (a parameter of more than one value), or leads to one through a
    chain of single-input nodes (a transpose, a cast, a view: ``F.linear(x, embedding.weight)``'s weight). A scalar
    parameter (a learnt temperature, a loss's learnt weight) scales what it meets: it makes no layer."""
    for _ in range(WEIGHT_CHAIN + 1):
        if hasattr(node, "variable"):
            return node.variable.numel() > 1
        inputs = [child for child, _ in node.next_functions if child is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def gives_loss(loss: torch.Tensor, output: torch.Tensor) -> bool | None:
    """Whether ``output`` is the model's output: the loss is computed from it through operations that take no
    parameter of their own (a reshape, a loss function), so no layer the forward hooks did not see comes between
    them (a head built in ``forward``, ``h @ self.weight``, a weight-tied ``F.linear``). None when the graph does not
    say: no graph, more than :data:`GRAPH_NODES` nodes walked, or a loss that does not depend on the model at all
    (``torch.tensor(loss.item(), requires_grad=True)``: ``missing_grad`` names that).

    >>> body, head = nn.Linear(3, 4), nn.Parameter(torch.randn(2, 4))
    >>> hidden = torch.relu(body(torch.randn(5, 3)))
    >>> gives_loss(hidden.sum(), hidden), gives_loss((hidden @ head.T).sum(), hidden)
    (True, False)
    >>> gives_loss((hidden * nn.Parameter(torch.ones(()))).sum(), hidden)  # a learnt scale makes no layer
    True
    >>> gives_loss(torch.tensor(1.0), hidden), gives_loss(torch.tensor(1.0, requires_grad=True).clone(), hidden)
    (None, None)
    """
    target, root = output.grad_fn, loss.grad_fn
    if target is None or root is None:
        return None
    frontier, seen, behind_weights = deque([root]), set(), False
    while frontier:
        node = frontier.popleft()
        if node is target:
            return True
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > GRAPH_NODES:
            return None
        inputs = [child for child, _ in node.next_functions if child is not None]
        if any(_weight_input(child) for child in inputs):
            behind_weights = True
        else:
            frontier.extend(inputs)
    return False if behind_weights else None


def same_values(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors are one tensor's values: itself, or a view of it of as many values (a ``squeeze(-1)``, a
    ``view``), read from their storage without touching the data.

    >>> x = torch.randn(4, 1)
    >>> same_values(x, x), same_values(x, x.squeeze(-1)), same_values(x, x[:2]), same_values(x, x * 2)
    (True, True, False, False)
    """
    if first is second:
        return True
    try:
        return (first.numel() == second.numel() and first.dtype == second.dtype
                and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
                and first.data_ptr() == second.data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a DTensor, a fake tensor)
        return False


def first_floating(output: object) -> torch.Tensor | None:
    """The tensor a module's output is judged by: itself, or the first floating tensor of a tuple/list/dict
    (an LSTM's ``(output, (h, c))``)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values: Iterable[object] = (output.values() if isinstance(output, dict)
                                else output if isinstance(output, (list, tuple)) else ())
    for value in values:
        found = first_floating(value)
        if found is not None:
            return found
    return None


def metric_names(names: Sequence[str], root: str = "model") -> list[str]:
    """Module paths as metric path components every logger accepts: ``[A-Za-z0-9_.-]`` only, unique (so
    ``debug/activation/<name>/<stat>`` is never also a prefix of another metric).

    >>> metric_names(["", "blocks.0.act", "head:out", "head_out"])
    ['model', 'blocks.0.act', 'head_out', 'head_out_2']
    """
    seen: set[str] = set()
    safe: list[str] = []
    for name in names:
        base = _METRIC_UNSAFE.sub("_", name) or root
        candidate, number = base, 1
        while candidate in seen:
            number += 1
            candidate = f"{base}_{number}"
        seen.add(candidate)
        safe.append(candidate)
    return safe
