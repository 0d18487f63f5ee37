"""A device-side copy of the buffers a training forward changes, to undo a skipped step's forward.

A BatchNorm forward in training mode updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` before anything can tell whether the step is healthy: a batch with one NaN
sample poisons them, and skipping the optimizer step leaves them poisoned (validation then runs on
NaN statistics for good). :class:`BufferSnapshot` copies those few buffers on the device before the
forward of a check step (one fused ``torch._foreach_copy_``, no host sync) and copies them back when
the step is skipped.

Which buffers: those of normalisation modules that track running statistics (``_NormBase``:
BatchNorm, SyncBatchNorm, InstanceNorm with ``track_running_stats``) and any buffer named
``running_*`` or ``num_batches_tracked`` elsewhere (custom norm layers). Constant buffers (masks,
position ids) are not copied: a forward does not change them.

Example::

    >>> import torch
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

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def _changed_by_forward(module: nn.Module, name: str) -> bool:
    return isinstance(module, _NormBase) or name.startswith("running_") or name == "num_batches_tracked"


class BufferSnapshot:
    """The copy of one model's forward-updated buffers taken at one step (see the module docstring)."""

    def __init__(self) -> None:
        self._holders: list[tuple[str, nn.Module, str]] = []
        self._module_id: int | None = None
        self._copies: list[torch.Tensor] = []
        self._ids: list[int] = []
        self.step = -1

    def _collect(self, model: nn.Module) -> None:
        if self._module_id != id(model):
            self._module_id = id(model)
            self._holders = [(f"{prefix}.{name}" if prefix else name, module, name)
                             for prefix, module in model.named_modules()
                             for name, buffer in module._buffers.items()
                             if buffer is not None and _changed_by_forward(module, name)]

    def buffers(self, model: nn.Module) -> list[torch.Tensor]:
        """The current tensors (``.to()`` replaces buffer objects, so they are looked up each time)."""
        self._collect(model)
        return [module._buffers[name] for _, module, name in self._holders  # type: ignore[misc]
                if module._buffers.get(name) is not None]

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self._holders]

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
            torch._foreach_copy_(self._copies, current)
        self.step = step

    def restore(self, model: nn.Module, step: int) -> bool:
        """Copy the buffers taken at ``step`` back; False when there is no such copy (or it no longer fits)."""
        current = self.buffers(model)
        if not current:
            return True
        if self.step != step or list(map(id, current)) != self._ids:
            return False
        with torch.no_grad():
            torch._foreach_copy_(current, self._copies)
        return True

    def nonfinite(self, model: nn.Module | None = None) -> list[str]:
        """The names of the floating buffers that hold NaN/Inf now (one fused pass and one host read)."""
        if model is not None:
            self._collect(model)
        pairs = [(name, module._buffers[attr]) for name, module, attr in self._holders
                 if module._buffers.get(attr) is not None]
        floating = [(name, buffer) for name, buffer in pairs if buffer.is_floating_point() and buffer.numel()]
        if not floating:
            return []
        with torch.no_grad():
            finite = torch.stack([torch.isfinite(buffer).all().to(floating[0][1].device) for _, buffer in floating])
        flags = finite.tolist()
        return [name for (name, _), ok in zip(floating, flags) if not ok]
