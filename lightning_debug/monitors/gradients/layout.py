"""Where a parameter sits: the module (layer) that owns it and its place from input to output::

    >>> module_of("encoder.0.weight")
    'encoder.0'
    >>> input_to_output(["b.weight", "a.weight"], {"a.weight": (0, 1), "b.weight": (1, 0)})
    ['a.weight', 'b.weight']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

Positions = Mapping[str, tuple[int, int]]
"""Sort keys (module position in the forward, registration index) of parameter names."""


def module_of(parameter_name: str) -> str:
    return parameter_name.rpartition(".")[0]


def input_to_output(names: Iterable[str], positions: Positions) -> list[str]:
    """``names`` sorted from the input side of the model to the output side (unknown names last)."""
    fallback = (len(positions) + 1, 0)
    return sorted(names, key=lambda name: positions.get(name, fallback))


@dataclass
class ModuleLayout:
    """Which module owns each parameter slot of an index: per-module sums are then one ``index_add_``::

        >>> layout = ModuleLayout.of(["a.w", "a.b", "c.w"], [torch.ones(2), torch.ones(1), torch.ones(3)])
        >>> layout.modules, layout.sums(torch.tensor([1.0, 2.0, 4.0])).tolist()
        (['a', 'c'], [3.0, 4.0])
    """

    modules: list[str]
    slot_module: torch.Tensor
    elements: torch.Tensor

    @classmethod
    def of(cls, names: Sequence[str], params: Sequence[torch.Tensor]) -> "ModuleLayout":
        position: dict[str, int] = {}
        slots = [position.setdefault(module_of(name), len(position)) for name in names]
        slot_module = torch.tensor(slots, dtype=torch.long)
        elements = torch.zeros(len(position), dtype=torch.float64).index_add_(
            0, slot_module, torch.tensor([float(p.numel()) for p in params], dtype=torch.float64))
        return cls(list(position), slot_module, elements)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(self.modules), dtype=torch.float64).index_add_(0, self.slot_module, values.double())


def replica_groups(model: torch.nn.Module) -> dict[str, list[tuple[object, ...]]]:
    """Per parameter name, its replica groups from the module tree alone: the parameters at the same path and of the
    same shape inside sibling modules of one type (the experts of an MoE layer, the layers of a stack)::

        >>> from torch import nn
        >>> groups = replica_groups(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1)))
        >>> groups["0.weight"] == groups["1.weight"] != groups["2.weight"]
        True
    """
    groups: dict[str, list[tuple[object, ...]]] = {}
    for parent_name, parent in model.named_modules():
        by_type: dict[type, list[tuple[str, torch.nn.Module]]] = {}
        for child_name, child in parent.named_children():
            by_type.setdefault(type(child), []).append((child_name, child))
        for kind, children in by_type.items():
            if len(children) < 2:
                continue
            for child_name, child in children:
                prefix = f"{parent_name}.{child_name}" if parent_name else child_name
                for relative, parameter in child.named_parameters():
                    key = (parent_name, kind, relative, tuple(parameter.shape))
                    groups.setdefault(f"{prefix}.{relative}", []).append(key)
    return groups
