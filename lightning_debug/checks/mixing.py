"""Whether the model's output for one sample depends on the other samples of its batch, read once per run by
backpropagating from one output row to the inputs ("use backprop to chart dependencies", from Karpathy's recipe for
training neural networks).

A model that treats samples one by one gives every other input row an exact zero gradient. Two mistakes mix them
with no error: a recurrent layer with ``batch_first=False`` fed ``(batch, time, features)`` runs its recurrence
across the samples, and a ``view`` where a ``transpose`` was meant regroups values of different samples into one.
Both learn a little, so the loss falls and nothing else looks wrong. Some models mix samples on purpose: BatchNorm in
training mode, a statistic over the batch, attention across the batch. The probe runs in eval mode (BatchNorm uses
its running statistics), and a mixing that shuffling the rows only shuffles (``f(x[p]) == f(x)[p]``: a
statistic or an attention over the batch) is not named; a recurrence over the rows, or a regrouping, depends on
their order::

    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> rnn = nn.LSTM(4, 8)  # batch_first=False, fed (batch, time, features)
    >>> call = Call(rnn, (torch.randn(16, 5, 4),), {})
    >>> found = probe(call, rows=13)
    >>> found.mixed, found.ordered, found.row, found.from_rows[:3], found.between
    (True, True, 12, [11, 10, 9], ('the inputs', "the model's output"))
    >>> probe(Call(nn.LSTM(4, 8, batch_first=True), (torch.randn(16, 5, 4),), {}), rows=13).mixed
    False
    >>> probe(Call(nn.BatchNorm1d(4).train(), (torch.randn(16, 4),), {}), rows=13).mixed
    False
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.activations import first_floating
from lightning_debug.checks.batches import named_tensors
from lightning_debug.checks.localize import _eager, _replaying
from lightning_debug.checks.numerics import compiled_wrapper

ROWS = 13
"""Rows of the batch the probe runs on (a prime: an output dimension of that size, a similarity between the rows, is
not judged, and few models have one)."""
RELATIVE = 1e-3
"""Another row's influence at most this share of the largest is rounding; a model that treats samples one by one
gives exact zeros."""
MAX_OUTPUTS = 256
"""Module outputs inside the model read for where the rows mix (the first ones to complete)."""
ORDER_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
"""How far ``f(x[::-1])`` may lie from ``f(x)[::-1]``, as a share of the output's largest value, for a mixing to be
called order-free (sums over the rows added in another order); 2e-2 in lower precisions."""


@dataclass
class Call:
    """The first module call of a training step that was given the batch (the model's forward), with its arguments."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Probe:
    """What the probe read: ``mixed`` when output row ``row`` depends on the inputs of ``from_rows`` (the largest
    influence first; ``own`` and ``other`` the largest norms of its gradient on its own input row and on another),
    ``ordered`` when shuffling the rows changes more than their order, ``between`` the two module outputs between
    which the rows mix."""

    rows: int
    mixed: bool = False
    ordered: bool = False
    row: int = -1
    from_rows: list[int] = field(default_factory=list)
    own: float = 0.0
    other: float = 0.0
    output_shape: list[int] = field(default_factory=list)
    leaves: str = "the inputs"
    between: tuple[str, str] = ("", "")

    @property
    def named(self) -> bool:
        return self.mixed and self.ordered


@dataclass
class Measured:
    """The probe's numbers still on the device (:func:`measure`), read with :meth:`read` once they reached the
    host: per output row of ``candidates``, the norm of its gradient on each row of the inputs and of each module
    output of ``labels`` (in the order they completed), then how far the output of the rows shuffled lies from the
    output shuffled alike, as a share of its largest value."""

    rows: int
    candidates: tuple[int, ...]
    labels: list[str]
    leaves: str
    output_shape: list[int]
    tolerance: float
    numbers: torch.Tensor

    def read(self, values: list[float]) -> Probe:
        result = Probe(self.rows, output_shape=list(self.output_shape), leaves=self.leaves)
        tensors = 1 + len(self.labels)
        per_row = [[values[(c * tensors + t) * self.rows:(c * tensors + t + 1) * self.rows] for t in range(tensors)]
                   for c in range(len(self.candidates))]
        for influences, row in zip(per_row, self.candidates):
            inputs = influences[0]
            largest = max(inputs)
            others = [value if index != row else 0.0 for index, value in enumerate(inputs)]
            if largest > 0 and max(others) > RELATIVE * largest:
                result.mixed, result.row, result.own, result.other = True, row, inputs[row], max(others)
                ranked = sorted(range(self.rows), key=lambda index: -others[index])
                result.from_rows = [index for index in ranked if others[index] > RELATIVE * largest][:8]
                result.between = self._between(influences[1:], row)
                break
        result.ordered = result.mixed and not values[-1] <= self.tolerance
        return result

    def _between(self, influences: list[list[float]], row: int) -> tuple[str, str]:
        """The last module output the row depends on through other rows too (the inputs when none), and the first
        after it it depends on through its own row alone."""
        before = self.leaves
        for label, values in zip(self.labels, influences):
            largest = max(values)
            if largest == 0:
                continue
            if max(value for index, value in enumerate(values) if index != row) <= RELATIVE * largest:
                return before, f"{label}'s output"
            before = f"{label}'s output"
        return before, "the model's output"


def shared_rows(value: Any) -> int | None:
    """Dimension 0 shared by every tensor of a nested argument structure of one dimension or more (None: none, or
    they differ: an index into the rows, a graph's edges)::

        >>> shared_rows(((torch.ones(4, 2), torch.zeros(4)), {"mask": torch.ones(4, 3)})), shared_rows((1, "a"))
        (4, None)
        >>> shared_rows((torch.ones(4, 2), torch.ones(2, 6)))
    """
    sizes = {int(t.shape[0]) for _, t in named_tensors(value) if t.dim() >= 1}
    return sizes.pop() if len(sizes) == 1 else None


def plain(value: Any) -> bool:
    """Whether ``value`` holds only tensors, containers and plain values: an object of another kind may hold rows
    the probe cannot take (a graph batch)::

        >>> plain(((torch.ones(2),), {"a": 1.0, "b": None})), plain((object(),))
        (True, False)
    """
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, Mapping):
        return all(plain(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(plain(item) for item in value)
    return False


def take_rows(value: Any, index: torch.Tensor, leaves: list[torch.Tensor] | None = None) -> Any:
    """``value`` with every tensor of one dimension or more cut to the rows ``index``; with ``leaves``, floating
    ones detached as new leaves that need a gradient, appended there (a copy of each is given)::

        >>> leaves = []
        >>> taken = take_rows({"x": (torch.arange(6.0).reshape(3, 2),), "n": 2}, torch.tensor([2, 0]), leaves)
        >>> taken["x"][0].tolist(), taken["n"], len(leaves), leaves[0].requires_grad
        ([[4.0, 5.0], [0.0, 1.0]], 2, 1, True)
    """
    if isinstance(value, torch.Tensor):
        if value.dim() < 1:
            return value
        taken = value.detach()[to_device(index, value.device)]
        if leaves is not None and taken.is_floating_point():
            leaves.append(taken.requires_grad_(True))
            return taken.clone()  # not the leaf itself: a forward may scale its input in place
        return taken
    if isinstance(value, Mapping):
        items = {key: take_rows(item, index, leaves) for key, item in value.items()}
        try:
            return type(value)(items)
        except Exception:
            return items
    if isinstance(value, tuple):
        items_list = [take_rows(item, index, leaves) for item in value]
        return type(value)(*items_list) if hasattr(value, "_fields") else tuple(items_list)
    if isinstance(value, list):
        return [take_rows(item, index, leaves) for item in value]
    return value


def measure(call: Call, rows: int = ROWS) -> Measured | None:
    """Run ``call``'s module on the first ``rows`` rows of its arguments in eval mode, backpropagate from three
    output rows (the last, the first, the middle one) to the inputs and to each module output of ``rows`` rows, and
    run it again on the rows shuffled (one fixed random permutation: reversing them commutes with some
    scrambles, a grid's transpose); no value is read (None: no output of ``rows`` rows with a graph, no input with
    a gradient, or an output that pairs the rows). Token ids have no gradient: the first floating output of a module
    without children becomes the input instead (an embedding's). The random state, the modules' modes and their
    parameters' gradients are as they were after it."""
    leaves: list[torch.Tensor] = []
    args, kwargs = take_rows((call.args, call.kwargs), torch.arange(rows), leaves)
    outputs: list[tuple[str, torch.Tensor]] = []
    with _Probing(call.module, rows, outputs, leaves, grad=True) as probing:
        call.module(*args, **kwargs)
    output = outputs[-1][1] if outputs else None
    if output is None or not leaves or any(size == rows for size in output.shape[1:]):
        return None
    inside = outputs[:-1][:MAX_OUTPUTS]
    weights = to_device(torch.randn(output.shape[1:], generator=torch.Generator().manual_seed(0)),
                        output.device).to(output.dtype)
    candidates = (rows - 1, 0, rows // 2)
    blocks = []
    for row in candidates:
        grads = torch.autograd.grad((output[row] * weights).sum(), leaves + [t for _, t in inside],
                                    retain_graph=True, allow_unused=True)
        blocks.append(_row_norms(grads[:len(leaves)], rows, output.device))
        blocks += [_row_norms([g], rows, output.device) for g in grads[len(leaves):]]
    shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    shuffled_args, shuffled_kwargs = take_rows((call.args, call.kwargs), shuffled)
    again: list[tuple[str, torch.Tensor]] = []
    with _Probing(call.module, rows, again, [], grad=False):
        call.module(*shuffled_args, **shuffled_kwargs)
    expected = output.detach()[to_device(shuffled, output.device)].float()
    if again and again[-1][1].shape == output.shape:
        scale = expected.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        error = ((again[-1][1].float() - expected).abs().max() / scale).reshape(1)
    else:
        error = torch.full((1,), math.inf, device=output.device)
    return Measured(rows, candidates, [label for label, _ in inside], probing.replaced or "the inputs",
                    list(output.shape), ORDER_TOLERANCE.get(output.dtype, 2e-2),
                    torch.cat(blocks + [error]).float().detach())


def probe(call: Call, rows: int = ROWS) -> Probe:
    """:func:`measure` read at once (one host read)."""
    measured = measure(call, rows)
    return Probe(rows) if measured is None else measured.read(measured.numbers.tolist())


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: a copy from pinned memory, queued behind the device's work
    (a plain copy from pageable memory waits for everything queued before it)::

        >>> to_device(torch.arange(3), torch.device("cpu")).tolist()
        [0, 1, 2]
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _row_norms(grads: Any, rows: int, device: torch.device) -> torch.Tensor:
    """The norm of the gradients on each row, summed over them (0 where a tensor got none)."""
    return sum((g.detach().reshape(rows, -1).float().norm(dim=1) for g in grads if g is not None),
               torch.zeros(rows, device=device))


class _Probing:
    """Eval mode (the modules' flags), the random state forked, compiled modules run eagerly, ``is_replaying()`` true, and hooks that
    keep each module output of ``rows`` rows (with a graph when ``grad``; the last is the model's). With ``grad`` and
    no leaf among the inputs (token ids), the first floating output of a module without children becomes a leaf
    that needs a gradient, appended to ``leaves``."""

    def __init__(self, module: nn.Module, rows: int, outputs: list[tuple[str, torch.Tensor]],
                 leaves: list[torch.Tensor], grad: bool) -> None:
        self.module, self.rows, self.outputs, self.leaves, self.grad = module, rows, outputs, leaves, grad
        self.names = {id(submodule): name for name, submodule in module.named_modules()}
        self.replace, self.replaced = grad and not leaves, ""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_Probing":
        modes = {submodule: submodule.training for submodule in self.module.modules()}
        self._stack.callback(_restore_modes, modes)
        _restore_modes(dict.fromkeys(modes, False))  # the flags alone: a user's train() override is not called
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self._stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        self._stack.enter_context(_eager())
        self._stack.enter_context(_replaying())
        self._stack.enter_context(torch.enable_grad() if self.grad else torch.no_grad())
        for submodule in hookable(self.module):
            handle = submodule.register_forward_hook(self._observe)
            self._stack.callback(handle.remove)
        return self

    def _observe(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.replace and not self.replaced and isinstance(output, torch.Tensor) and output.is_floating_point() \
                and output.dim() >= 1 and output.shape[0] == self.rows and not any(True for _ in module.children()):
            name = self.names.get(id(module), "")
            self.replaced = f"`{name}` ({type(module).__name__})'s output"
            leaf = output.detach().requires_grad_(True)
            self.leaves.append(leaf)
            return leaf.clone()  # a model may scale its embeddings in place
        tensor = first_floating(output)
        if tensor is not None and tensor.dim() >= 1 and tensor.shape[0] == self.rows and (
                tensor.requires_grad or not self.grad):
            name = self.names.get(id(module), "")
            self.outputs.append((f"`{name}` ({type(module).__name__})" if name else f"the {type(module).__name__}",
                                 tensor))
        return None

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def _restore_modes(modes: dict[nn.Module, bool]) -> None:
    for module, training in modes.items():
        module.training = training


def hookable(root: nn.Module) -> Iterator[nn.Module]:
    """Every module, none inside a ``torch.compile``d one (a hook there makes Dynamo recompile)."""
    compiled: list[nn.Module] = []
    for module in root.modules():
        if any(module is not c and any(module is m for m in c.modules()) for c in compiled):
            continue
        if compiled_wrapper(module):
            compiled.append(module)
        yield module
