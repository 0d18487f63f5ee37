"""Where a parameter sits: the module (layer) that owns it and its place from input to output.

Example::

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
    """Which module owns each parameter slot of an index, built once per index: per-module sums of
    per-parameter values are then one ``index_add_`` (no Python loop over parameters per check).

    Example::

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
