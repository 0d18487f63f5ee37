"""Moving device values to the host without stalling the GPU: on CUDA a blocking read waits for every kernel queued
so far; a deferred one copies into pinned memory behind a CUDA event, read once it completed (a step later)."""

from __future__ import annotations

import torch


class Readback:
    """A 1-d device tensor on its way to the host: ``blocking=True`` reads it now (one sync on CUDA); otherwise
    :meth:`ready` tells when :meth:`values` can be called without waiting.

        >>> Readback(torch.tensor([1.0, 2.0]), blocking=False).values()
        [1.0, 2.0]
    """

    def __init__(self, tensor: torch.Tensor, blocking: bool) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cpu":  # already on the host: no copy, no operation
            self._host = tensor.detach() if tensor.requires_grad else tensor
            if self._host.dim() != 1:
                self._host = self._host.reshape(-1)
            self._values: list[float] | None = None
            return
        tensor = tensor.detach().reshape(-1)
        if tensor.device.type == "cuda" and not blocking:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.to("cpu")
        self._values: list[float] | None = None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def tensor(self) -> torch.Tensor:
        """The values as a CPU tensor (waits for the copy if it has not completed)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def values(self) -> list[float]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            values = self._host.tolist()
            self._values = values if self._host.is_floating_point() else [float(v) for v in values]
        return self._values
