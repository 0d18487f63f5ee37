"""Loss, gradient and parameter health of one optimizer step, computed once for every check.

The anomaly and gradient checks both need gradient norms; computing them twice would double the
cost. :class:`StepNumerics` does one fused pass, packs everything (per-rank flags included) into
one device vector, and reads it back to the host at most once, now or a step later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_debug.checks.numerics import fused_norms, nonfinite_named
from lightning_debug.core.readback import Readback

RANK_FIELDS = ("loss_finite", "grad_nonfinite", "param_nonfinite", "grad_square_sum")
AllGather = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class HostNumerics:
    """The host-side values of a :class:`StepNumerics`."""

    step: int
    ranks: list[dict[str, float]]
    grad_names: list[str]
    grad_norms: list[float]
    param_names: list[str]
    param_norms: list[float]
    missing: list[str]
    grads_sharded: bool
    scan_parameters: Callable[[], list[tuple[str, float]]] | None = None
    read_before_update: bool = True

    @property
    def loss_checked(self) -> bool:
        return all(rank["loss_finite"] >= 0 for rank in self.ranks)

    @property
    def ranks_with_nonfinite_loss(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["loss_finite"] == 0]

    @property
    def ranks_with_nonfinite_grads(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["grad_nonfinite"] > 0]

    @property
    def ranks_with_nonfinite_params(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["param_nonfinite"] > 0]

    @property
    def global_grad_norm(self) -> float:
        squares = [rank["grad_square_sum"] for rank in self.ranks]
        return math.sqrt(sum(squares) if self.grads_sharded else squares[0])

    def nonfinite_grads(self) -> list[tuple[str, float]]:
        return [(n, v) for n, v in zip(self.grad_names, self.grad_norms) if not math.isfinite(v)]

    def nonfinite_params(self) -> list[tuple[str, float]]:
        """Non-finite parameters: from the step's norms when they were computed, else scanned now."""
        if not self.param_norms and self.scan_parameters is not None:
            return self.scan_parameters()
        return [(n, v) for n, v in zip(self.param_names, self.param_norms) if not math.isfinite(v)]


class StepNumerics:
    """Device-side measurement of one optimizer step; see the module docstring.

    Args:
        step: The optimizer step measured.
        named_parameters: The model's ``(name, parameter)`` pairs; only trainable, non-empty ones count.
        loss_finite: 0-d bool tensor, all losses of this step finite, or None when nobody looked.
        all_gather: Gathers a 1-d tensor from every rank into ``[world, n]``; None on one process.
        grads_sharded: Gradients are shards (FSDP), so squared norms add up across ranks.
        with_param_norms: Also compute every parameter's norm (for weight norms and update ratios).
            Without it, parameters are scanned only when asked (:meth:`scan_parameters`), which the
            anomaly check does when the loss or gradients are non-finite: a non-finite weight shows
            up there on the next forward, so healthy steps skip a full pass over the weights.
        grad_scale: The loss scale still applied to the gradients (fp16 GradScaler before unscaling,
            as in an Accelerate loop right after backward): norms are divided by it on the device.
    """

    def __init__(self, step: int, named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
                 loss_finite: torch.Tensor | None, all_gather: AllGather | None = None,
                 grads_sharded: bool = False, grad_scale: torch.Tensor | None = None,
                 with_param_norms: bool = False) -> None:
        self.step = step
        self.grads_sharded = grads_sharded
        trainable = [(name, p) for name, p in named_parameters if p.requires_grad and p.numel() > 0]
        with_grad = [(name, p) for name, p in trainable if p.grad is not None]
        self.missing = [name for name, p in trainable if p.grad is None]
        self.grad_names = [name for name, _ in with_grad]
        self.param_names = [name for name, _ in trainable]
        self.parameters = [p for _, p in trainable]
        device = (self.parameters[0].device if self.parameters
                  else loss_finite.device if loss_finite is not None else torch.device("cpu"))
        self.grad_norms = fused_norms([p.grad for _, p in with_grad], device)  # type: ignore[misc]
        if grad_scale is not None:
            self.grad_norms = self.grad_norms / grad_scale.detach().to(device=device, dtype=torch.float32)
        self.param_norms = (fused_norms(self.parameters, device) if with_param_norms
                            else torch.zeros(0, dtype=torch.float32, device=device))
        loss_flag = (loss_finite.to(device=device, dtype=torch.float32) if loss_finite is not None
                     else torch.full((), -1.0, device=device))
        row = torch.stack([
            loss_flag,
            (~torch.isfinite(self.grad_norms)).sum().float(),
            (~torch.isfinite(self.param_norms)).sum().float(),
            self.grad_norms.square().sum(),
        ])
        rows = all_gather(row).reshape(-1, len(RANK_FIELDS)) if all_gather is not None else row.unsqueeze(0)
        self.world_size = rows.shape[0]
        self.packed = torch.cat([rows.reshape(-1), self.grad_norms, self.param_norms])
        self._readback: Readback | None = None
        self._read_blocking = False
        self._host: HostNumerics | None = None
        self._subscribers: list[Callable[[HostNumerics], None]] = []

    def scan_parameters(self) -> list[tuple[str, float]]:
        """Names and norms of the non-finite parameters, now (one sync; the anomaly path only).

        When the values were read synchronously (every rank at the same point of the same step), the
        count is max-reduced across processes, so all ranks agree even with sharded parameters. A
        deferred read completes at different times on different GPUs, so it issues no collective.
        """
        norms = fused_norms(self.parameters)
        count = (~torch.isfinite(norms)).sum()
        if self._read_blocking and self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if not int(count):
            return []
        return nonfinite_named(self.param_names, norms)

    def subscribe(self, consumer: Callable[[HostNumerics], None]) -> None:
        """Call ``consumer`` with the host values once they are read back."""
        self._subscribers.append(consumer)

    def stage(self, blocking: bool) -> None:
        if self._readback is None:
            self._readback = Readback(self.packed, blocking=blocking)
            self._read_blocking = blocking

    def ready(self) -> bool:
        return self._readback is not None and self._readback.ready()

    def read(self, blocking: bool = True) -> HostNumerics:
        """Host values; with ``blocking`` a sync on CUDA if the deferred copy has not completed."""
        if self._host is None:
            self.stage(blocking)
            assert self._readback is not None
            values = self._readback.values()
            width = len(RANK_FIELDS)
            ranks = [dict(zip(RANK_FIELDS, values[i * width:(i + 1) * width])) for i in range(self.world_size)]
            offset = self.world_size * width
            grads_end = offset + len(self.grad_names)
            self._host = HostNumerics(
                step=self.step, ranks=ranks, grad_names=self.grad_names, grad_norms=values[offset:grads_end],
                param_names=self.param_names, param_norms=values[grads_end:], missing=self.missing,
                grads_sharded=self.grads_sharded, scan_parameters=self.scan_parameters,
                read_before_update=self._read_blocking,
            )
        return self._host

    def deliver(self) -> None:
        host = self.read(blocking=True)
        subscribers, self._subscribers = self._subscribers, []
        for consumer in subscribers:
            consumer(host)
