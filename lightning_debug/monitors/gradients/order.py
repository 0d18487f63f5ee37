"""The order in which modules run, watched once, so findings name layers from the input side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lightning_debug.checks.localize import tensors_in
from lightning_debug.checks.numerics import compiled_wrapper, user_name
from lightning_debug.monitors.gradients.layout import module_of


class ForwardOrder:
    """The order in which modules first run in a forward pass (registration order often differs), recorded once
    with pre-hooks. A shared parameter takes the position of the first module to run, those of modules never
    entered come last; no hook goes inside a ``torch.compile``d module (Dynamo would recompile)::

        >>> import torch
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> order = ForwardOrder(); order.watch(model); _ = model(torch.ones(1, 2)); order.stop()
        >>> order.module_names
        ['', '0', '1']
        >>> tied = nn.ModuleDict({"head": nn.Linear(2, 2), "embed": nn.Linear(2, 2)})
        >>> tied.head.weight = tied.embed.weight
        >>> order.watch(tied); _ = tied.head(tied.embed(torch.ones(1, 2))); order.stop()
        >>> order.positions(["head.weight", "head.bias", "embed.bias"])
        {'head.weight': (0, 0), 'head.bias': (1, 1), 'embed.bias': (0, 2)}
        >>> order.watch(tied); _ = tied.embed(torch.ones(1, 2)); order.stop()
        >>> order.called(["head.weight", "head.bias", "embed.bias"])
        {'head.weight': True, 'head.bias': False, 'embed.bias': True}

    It also keeps which modules ran without building a graph (no output needs a gradient).

        >>> order.watch(model)
        >>> with torch.no_grad():
        ...     _ = model[0](torch.ones(1, 2))
        >>> _ = model[1](torch.ones(1, 2)); order.stop()
        >>> sorted(order.without_graph(["0.weight", "0.bias", "1.weight"]))
        ['0.bias', '0.weight']
    """

    def __init__(self) -> None:
        self.module_names: list[str] = []
        self._seen: set[str] = set()
        self._handles: list[Any] = []
        self._compiled: list[str] = []
        self._holders: dict[str, list[str]] = {}
        self._outputs: dict[str, bool] = {}

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def watch(self, root: nn.Module) -> None:
        self.stop()
        self.module_names, self._seen, self._compiled, self._outputs = [], set(), [], {}
        first_name: dict[int, str] = {}
        self._holders = {}
        for module_name, module in root.named_modules():
            for local, param in module.named_parameters(recurse=False):
                owner = user_name(f"{module_name}.{local}" if module_name else local)
                self._holders.setdefault(first_name.setdefault(id(param), owner), []).append(user_name(module_name))
        for name, module in root.named_modules():
            name = user_name(name)
            if any(name == c or name.startswith(c + ".") for c in self._compiled):
                continue
            if compiled_wrapper(module):
                self._compiled.append(name)
            self._handles.append(module.register_forward_pre_hook(self._hook_for(name)))
            if any(True for _ in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_hook(self._output_hook_for(name)))

    def _hook_for(self, name: str) -> Callable[..., None]:
        def seen(module: nn.Module, args: Any) -> None:
            if name not in self._seen:
                self._seen.add(name)
                self.module_names.append(name)
        return seen

    def _output_hook_for(self, name: str) -> Callable[..., None]:
        def ran(module: nn.Module, args: Any, output: Any) -> None:
            if not self._outputs.get(name):
                tensors = tensors_in(output)
                if tensors:
                    self._outputs[name] = any(tensor.requires_grad for tensor in tensors)
        return ran

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def called(self, parameter_names: Sequence[str]) -> dict[str, bool]:
        """Per parameter, whether a module holding it ran (inside a compiled module: left out, unknown)."""
        seen = set(self.module_names)

        def inside_compiled(module: str) -> bool:
            return any(module.startswith(c + ".") for c in self._compiled)

        called = {}
        for name in parameter_names:
            holders = self._holders.get(name) or [module_of(name)]
            if any(holder in seen for holder in holders):
                called[name] = True
            elif not all(inside_compiled(holder) for holder in holders):
                called[name] = False
        return called

    def without_graph(self, parameter_names: Sequence[str]) -> set[str]:
        """The parameters whose every holding module that ran built no graph with its output."""
        found = set()
        for name in parameter_names:
            holders = [holder for holder in self._holders.get(name) or [module_of(name)] if holder in self._outputs]
            if holders and not any(self._outputs[holder] for holder in holders):
                found.add(name)
        return found

    def positions(self, parameter_names: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Sort keys (module position, registration index) for each parameter name."""
        rank = {name: index for index, name in enumerate(self.module_names)}
        unseen = len(rank)

        def module_position(module: str) -> int:
            inside = next((c for c in self._compiled if module == c or module.startswith(c + ".")), None)
            return rank.get(inside if inside is not None else module, unseen)

        def parameter_position(name: str) -> int:
            holders = self._holders.get(name) or [module_of(name)]
            return min(module_position(holder) for holder in holders)

        return {name: (parameter_position(name), index) for index, name in enumerate(parameter_names)}

