"""Where a NaN/Inf entered the backward pass: the first backward operation that made a non-finite gradient
from finite incoming ones.

``torch.autograd.detect_anomaly(check_nan=True)`` stops at the first backward that returns NaN, which is
often not where the problem is: the derivative of ``sqrt`` at 0 is Inf, and the NaN appears only in the
backward after it that multiplies the Inf by 0 (``pow``'s, in a triplet loss of identical embeddings).
So every node of the graph gets a hook that compares what flows in with what flows out, and the first
node where finite gradients became NaN or Inf is the one named, with the forward traceback that anomaly
mode keeps on it. Used only by the replay of a bad step (it reads every gradient: a slow path).

Example::

    >>> import torch
    >>> x = torch.ones(3, requires_grad=True)
    >>> def step():
    ...     d = (x - x).pow(2).sum()
    ...     return x.sum() + d.sqrt()
    >>> name, what, trace = first_nonfinite_backward(step, [x])
    >>> name, what, "d.sqrt()" in trace
    ('SqrtBackward0', 'Inf', True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _nonfinite(tensors: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()) for t in tensors)


def _watch(loss: torch.Tensor, first: list[tuple[Any, str]]) -> list[Any]:
    """A hook on every node of ``loss``'s graph keeping, in ``first``, the first node whose backward made a
    non-finite gradient from finite incoming ones."""
    handles: list[Any] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)

        def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any], node: Any = node) -> None:
            if not first and not _nonfinite(grad_outputs) and _nonfinite(grad_inputs):
                nan = any(isinstance(g, torch.Tensor) and bool(torch.isnan(g).any()) for g in grad_inputs)
                first.append((node, "NaN" if nan else "Inf"))

        handles.append(node.register_hook(hook))
        stack.extend(function for function, _ in node.next_functions)
    return handles


def first_nonfinite_backward(run: Callable[[], torch.Tensor | None],
                             parameters: Sequence[torch.Tensor]) -> tuple[str, str, str] | None:
    """Run ``run()`` (the step's loss) and its backward to ``parameters``; return the name of the first
    backward node that made NaN/Inf from finite gradients, ``"NaN"`` or ``"Inf"``, and the forward traceback
    of its operation (text, empty if unknown), or None when the backward stays finite."""
    first: list[tuple[Any, str]] = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=False):  # keeps each node's forward traceback
            loss = run()
            if loss is None or not loss.requires_grad:
                return None
            handles = _watch(loss, first)
            try:
                torch.autograd.grad(loss, list(parameters), allow_unused=True)
            finally:
                for handle in handles:
                    handle.remove()
    if not first:
        return None
    node, what = first[0]
    trace = getattr(node, "metadata", {}).get("traceback_")
    return node.name(), what, "".join(trace) if isinstance(trace, list) else str(trace or "")
