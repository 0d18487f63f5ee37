"""Module buffers a training forward changes: a copy to undo a skipped step's forward, and a watch for broken ones.

A BatchNorm forward updates its running statistics before anything can tell whether the step is healthy, so
skipping the optimizer step would leave them poisoned (docs/anomaly.md, "skip"): :class:`BufferSnapshot` copies
them on the device before a check step's forward and back when the step is skipped.
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> snapshot = BufferSnapshot()
    >>> snapshot.take(model, step=0)
    >>> _ = model(torch.tensor([[float("nan"), 1.0], [0.0, 1.0]]))
    >>> snapshot.nonfinite()
    ['1.running_mean', '1.running_var']
    >>> snapshot.restore(model, step=0), snapshot.nonfinite()
    (True, [])
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.modules import batchnorm
from torch.nn.parameter import is_lazy

from lightning_debug.checks import fused

# the base of torch's running-statistics norms is private: the public classes where a torch lacks it
NORM_MODULES = getattr(batchnorm, "_NormBase", None) or (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
    nn.InstanceNorm3d)
SMALL_NUMEL_CPU = 4096  # on the CPU, buffers this small are joined into one vector and read at once


def _named_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(dotted name, module, attribute, buffer) of every buffer of ``model``."""
    return [(f"{prefix}.{name}" if prefix else name, module, name, buffer)
            for prefix, module in model.named_modules() for name, buffer in module._buffers.items()
            if buffer is not None]


class BufferSnapshot:
    """The copy of one model's forward-updated buffers taken at one step."""

    def __init__(self) -> None:
        self._holders: list[tuple[str, nn.Module, str]] = []
        self._module_id: int | None = None
        self._copies: list[torch.Tensor] = []
        self._ids: list[int] = []
        self.step = -1

    def _collect(self, model: nn.Module) -> None:
        if self._module_id != id(model):
            self._module_id = id(model)
            self._holders = [(name, module, attr) for name, module, attr, _ in _named_buffers(model)
                             if isinstance(module, NORM_MODULES) or attr.startswith("running_")
                             or attr == "num_batches_tracked"]

    def buffers(self, model: nn.Module) -> list[torch.Tensor]:
        """The current tensors (``.to()`` replaces buffer objects, so they are looked up each time)."""
        self._collect(model)
        return [module._buffers[name] for _, module, name in self._holders  # type: ignore[misc]
                if module._buffers.get(name) is not None]

    def take(self, model: nn.Module, step: int) -> None:
        """Copy the buffers now, on their devices (a no-op for a model without such buffers)."""
        current = self.buffers(model)
        if not current:
            self.step = step
            return
        ids = list(map(id, current))
        if ids != self._ids and (len(self._copies) != len(current) or any(
                copy.shape != buffer.shape or copy.dtype != buffer.dtype or copy.device != buffer.device
                for copy, buffer in zip(self._copies, current))):
            self._copies = [torch.empty_like(buffer) for buffer in current]
        self._ids = ids
        with torch.no_grad():
            fused.copy_(self._copies, current)
        self.step = step

    def restore(self, model: nn.Module, step: int) -> bool:
        """Copy the buffers taken at ``step`` back; False when there is no such copy (or it no longer fits)."""
        current = self.buffers(model)
        if not current:
            return True
        if self.step != step or list(map(id, current)) != self._ids:
            return False
        with torch.no_grad():
            fused.copy_(current, self._copies)
        return True

    def nonfinite(self, model: nn.Module | None = None) -> list[str]:
        """The names of the floating buffers that hold NaN/Inf now (one fused pass and one host read)."""
        if model is not None:
            self._collect(model)
        floating = [(name, buffer) for name, module, attr in self._holders
                    if (buffer := module._buffers.get(attr)) is not None and buffer.is_floating_point() and buffer.numel()]
        return [name for (name, _), ok in zip(floating, _finite([b for _, b in floating]))
                if not ok] if floating else []


class BufferWatch:
    """The floating and complex buffers of one model, measured together on check steps (no sync).

    A finite input of 1e20 gives a batch variance of 1e40, Inf in float32, while the loss, the gradients and the
    weights stay finite. So each buffer's largest magnitude is taken (a fused norm of order infinity, which cannot
    overflow as a sum of squares can) and their maximum travels in the step's one read-back. A buffer not finite
    when first seen is a constant the model means (an attention mask of ``-inf``) and is not watched.
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
        >>> watch = BufferWatch()
        >>> bool(torch.isfinite(watch.measure(model)))
        True
        >>> _ = model(torch.tensor([[1e20, 1.0], [-1e20, 1.0]]))
        >>> bool(torch.isfinite(watch.measure(model))), watch.nonfinite(model)
        (False, [('1.running_var', 'BatchNorm1d')])
    """

    def __init__(self) -> None:
        self._module_id: int | None = None
        self._holders: list[tuple[str, nn.Module, str]] = []
        self._planned: list[torch.Tensor | None] = []
        self._plan: list[tuple[str, list[torch.Tensor]]] = []

    def watch(self, model: nn.Module) -> None:
        """Find the buffers to watch now (one host read, at fit start rather than on the first check step)."""
        self._collect(model)

    def _collect(self, model: nn.Module) -> None:
        if self._module_id == id(model):
            return
        named = _named_buffers(model)
        # a lazy module's buffers exist after its first forward: looked for again until then
        self._module_id = None if any(is_lazy(buffer) for *_, buffer in named) else id(model)
        holders = [(name, module, attr) for name, module, attr, buffer in named if not is_lazy(buffer)
                   and (buffer.is_floating_point() or buffer.is_complex()) and buffer.numel()]
        self._holders = holders
        if holders:  # once per model: which buffers are finite to begin with
            finite = _finite([buffer for _, _, buffer in self._current()])
            self._holders = [holder for holder, ok in zip(holders, finite) if ok]

    def _current(self) -> list[tuple[str, nn.Module, torch.Tensor]]:
        return [(name, module, module._buffers[attr]) for name, module, attr in self._holders  # type: ignore[misc]
                if module._buffers.get(attr) is not None]

    def measure(self, model: nn.Module) -> torch.Tensor | None:
        """The largest magnitude over the watched buffers, a 0-d float64 device tensor (None without buffers)."""
        self._collect(model)
        current = [module._buffers.get(attr) for _, module, attr in self._holders]
        if len(current) != len(self._planned) or any(a is not b for a, b in zip(current, self._planned)):
            self._planned, self._plan = current, _plan([b for b in current if b is not None])
        if not self._plan:
            return None
        with torch.no_grad():
            highs = [_high(how, tensors) for how, tensors in self._plan]
            if len(highs) == 1:
                return highs[0].to(torch.float64)
            device = highs[0].device
            return torch.stack([high.to(device, torch.float64) for high in highs]).max()

    def nonfinite(self, model: nn.Module) -> list[tuple[str, str]]:
        """The watched buffers that hold NaN/Inf now, with their module's class (one host read)."""
        self._collect(model)
        current = self._current()
        if not current:
            return []
        finite = _finite([buffer for _, _, buffer in current])
        return [(name, type(module).__name__) for (name, module, _), ok in zip(current, finite) if not ok]


def _plan(buffers: list[torch.Tensor]) -> list[tuple[str, list[torch.Tensor]]]:
    """How to read ``buffers``: per device and dtype, ``torch._foreach_norm`` (one kernel per dtype on a GPU, but one
    per tensor on the CPU, where the small buffers are joined into one vector read by one ``abs().max()``)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buffer in buffers:
        groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    plan: list[tuple[str, list[torch.Tensor]]] = []
    for (device, _), group in groups.items():
        if device.type != "cpu":
            plan.append(("norm", group))
            continue
        small = [t.reshape(-1) for t in group if t.numel() <= SMALL_NUMEL_CPU]
        large = [t for t in group if t.numel() > SMALL_NUMEL_CPU]
        plan += [(how, tensors) for how, tensors in (("join", small), ("norm", large)) if tensors]
    return plan


def _high(how: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of ``tensors`` (one device and dtype), a 0-d tensor that carries NaN/Inf."""
    if how == "norm":
        return torch.stack(fused.norms(tensors, math.inf)).max()
    return torch.cat(tensors).abs().max()


def _finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is finite everywhere: one host read for all of them."""
    with torch.no_grad():
        device = tensors[0].device
        return torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).tolist()
