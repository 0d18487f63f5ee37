"""The tensors a loss's backward writes a gradient into, and where a module keeps those it does not register.

Autograd accumulates a gradient into every leaf tensor that requires one and that the loss was computed from: the
``AccumulateGrad`` nodes of its graph. Comparing them with the model's parameters finds what the model uses without
owning: layers kept in a Python list (``self.layers = [nn.Linear(...)]``) and tensors made with
``requires_grad=True`` instead of ``nn.Parameter``::

    >>> from torch import nn
    >>> model = nn.Linear(3, 2)
    >>> model.extra = [nn.Linear(2, 2)]
    >>> loss = model.extra[0](model(torch.randn(4, 3))).sum()
    >>> found = [t for t in graph_leaves(loss) if not any(t is p for p in model.parameters())]
    >>> sorted(attribute_paths(model, found).values())
    ['extra[0].bias', 'extra[0].weight']
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

LEAF_NODES = 20_000
"""How many autograd nodes :func:`graph_leaves` walks at most (a 12-layer transformer's graph has a few thousand)."""
ITEMS_SEARCHED = 1_000
"""How many items of one list, tuple or dict attribute :func:`attribute_paths` looks into."""
MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})


def graph_leaves(loss: torch.Tensor, limit: int = LEAF_NODES) -> list[torch.Tensor]:
    """The leaf tensors ``loss``'s backward accumulates a gradient into, each once, from at most ``limit`` nodes::

        >>> w = torch.ones(2, requires_grad=True)
        >>> [t is w for t in graph_leaves((w * 2 + w).sum())], graph_leaves(torch.ones(()))
        ([True], [])
    """
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return []
    stack, seen, leaves, kept = [root], set(), [], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in kept:
            kept.add(id(variable))
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def _tensors_in(value: Any, path: str, depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, nn.Module):
        for name, tensor in value.named_parameters():
            yield f"{path}.{name}", tensor
    elif depth and isinstance(value, (list, tuple)):
        for index, item in enumerate(value[:ITEMS_SEARCHED]):
            yield from _tensors_in(item, f"{path}[{index}]", depth - 1)
    elif depth and isinstance(value, dict):
        for index, (key, item) in enumerate(value.items()):
            if index >= ITEMS_SEARCHED:
                break
            yield from _tensors_in(item, f"{path}[{key!r}]", depth - 1)


def attribute_paths(model: nn.Module, tensors: Sequence[torch.Tensor]) -> dict[int, str]:
    """Where ``model`` or one of its modules keeps each of ``tensors`` outside its registered parameters, by ``id``:
    an attribute, an item of a list or dict attribute, a parameter of an unregistered module in one (``layers[0].weight``)."""
    wanted = {id(tensor) for tensor in tensors}
    found: dict[int, str] = {}
    for prefix, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in MODULE_INTERNALS:
                continue
            for path, tensor in _tensors_in(value, f"{prefix}.{attribute}" if prefix else attribute):
                if id(tensor) in wanted:
                    found.setdefault(id(tensor), path)
    return found


__all__ = ["LEAF_NODES", "attribute_paths", "graph_leaves"]
