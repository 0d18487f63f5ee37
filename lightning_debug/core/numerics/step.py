"""The device-side measurement of one optimizer step: one fused pass, one collective, one read-back.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_debug.core.numerics.index import ParameterIndex
    >>> model = nn.Linear(2, 1, bias=False)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> host = StepNumerics(0, ParameterIndex(list(model.named_parameters()))).read()
    >>> round(host.global_grad_norm, 4), host.grads_finite
    (1.4142, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_debug.core.numerics.host import HostNumerics
from lightning_debug.core.numerics.index import ParameterIndex
from lightning_debug.core.numerics.observed import Observed
from lightning_debug.core.numerics.rows import (
    DEVICE_FIELDS,
    RANK_FIELDS,
    AllReduce,
    constant,
    rank_flags,
    world_position,
)
from lightning_debug.core.readback import Readback


class StepNumerics:
    """Device-side measurement of one optimizer step; see :mod:`lightning_debug.core.numerics`.

    Args:
        step: The optimizer step measured.
        index: The parameters to measure (see :class:`ParameterIndex`).
        observed: The step's losses and batches (:class:`Observed`), or None when nobody looked.
        all_reduce: Sums a float64 vector over every process in place (the WORLD group); None on
            one process. Called exactly once, by every rank, with a vector of the same length.
        grad_scale: The loss scale still applied to the gradients (fp16 GradScaler before unscaling,
            as in an Accelerate loop right after backward): norms are divided by it on the device.
        with_param_norms: Also compute every parameter's norm (for weight norms and update ratios).
            Without it, parameters are scanned only when asked (:func:`scan_parameters`), which the
            anomaly check does when the loss or gradients are non-finite: a non-finite weight shows
            up there on the next forward, so healthy steps skip a full pass over the weights.
        gradients: ``index.local_grads()`` when the caller already collected them.

    The device work of a healthy step is the fused norm pass and three operations (a sum, the
    stack of the row, the concatenation), whatever the number of parameters. One process on a CPU
    has nothing to reduce or copy: it skips the concatenation and reads the row and the squared
    norms where they are.
    """

    def __init__(self, step: int, index: ParameterIndex, observed: Observed | None = None,
                 all_reduce: AllReduce | None = None, grad_scale: torch.Tensor | None = None,
                 with_param_norms: bool = False,
                 gradients: tuple[list[torch.Tensor], list[int]] | None = None) -> None:
        self.step = step
        self.index = index
        self.error: Exception | None = None
        loss = observed.loss_sum if observed is not None else None
        device = index.device if len(index) else loss.device if loss is not None else torch.device("cpu")
        self.with_param_norms = with_param_norms and len(index) > 0
        zero, nan = constant(0.0, device), constant(math.nan, device)
        host_row = [float(observed.loss_count), float(observed.input_count), 0.0] if observed is not None \
            else [0.0, 0.0, 0.0]
        try:
            grads, missing = gradients if gradients is not None else index.local_grads()
            # with plain shards a gradient missing here may live on another rank: none is reported missing
            self.missing_slots = [] if index.plain_sharded else missing
            # no parameter has a gradient: no backward ran for this optimizer step (a training_step that
            # returned None, which Lightning skips); such a step has nothing to judge
            self.without_gradients = bool(missing) and len(missing) == len(index) and not index.plain_sharded
            grad_squares = (index.plan.squares(grads) if len(index)
                            else torch.zeros(0, dtype=torch.float64, device=device))
            if grad_scale is not None:
                grad_squares = grad_squares / grad_scale.detach().to(device=device, dtype=torch.float64).square()
            grad_local = grad_squares.sum()
            grad_terms, grad_owned = index.grad_owner.terms(grad_squares, grad_local)
            pieces = [grad_terms]
            param_local = zero
            if self.with_param_norms:
                param_squares = index.plan.squares(index.local_params())
                param_local = param_squares.sum()
                pieces.append(index.param_owner.terms(param_squares, param_local)[0])
            ends = observed.input_ends() if observed is not None else None
            low, high = ends if ends is not None else (zero, zero)
            buffers = observed.buffer_high if observed is not None else None
            values = [loss if loss is not None else nan, low, high, grad_local, grad_owned, param_local,
                      buffers if buffers is not None else zero]
            values = [value if value.device == device else value.to(device, non_blocking=True) for value in values]
        except Exception as error:  # still join the collective, flagged, so that no rank waits or decides alone
            self.error = error
            self.missing_slots = []
            self.without_gradients = False
            pieces = [torch.zeros(len(index) * (2 if self.with_param_norms else 1), dtype=torch.float64,
                                  device=device)]
            host_row = [0.0, 0.0, 1.0]
            values = [nan, zero, zero, zero, zero, zero, zero]
        row = torch.stack(values)
        rank, world = world_position() if all_reduce is not None else (0, 1)
        self.world_size = world
        if world > 1:
            width = len(RANK_FIELDS)
            packed = torch.zeros(world * width + sum(piece.numel() for piece in pieces), dtype=torch.float64,
                                 device=device)
            packed[rank * width:(rank + 1) * width] = torch.cat([torch.tensor(host_row, dtype=torch.float64,
                                                                              device=device), row])
            packed[world * width:] = torch.cat(pieces)
            all_reduce(packed)  # type: ignore[misc]
            self.packed = packed
            self._host_row: list[float] | None = None
        elif device.type == "cpu":  # nothing to reduce or copy: the row and the squares stay apart, unpacked
            self.packed = None
            self._cpu_parts = (row, pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            self._host_row = host_row
        else:
            self.packed = torch.cat([row, *pieces])
            self._host_row = host_row
        # How many optimizer steps have been taken by now (set by NumericsQueue): which update a late scan sees.
        self.steps_done: Callable[[], int] | None = None
        # How the parameter scan sums its flags over ranks (set by NumericsQueue: the run's gate).
        self.flags_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._readback: Readback | None = None
        self._staged = False
        self._read_blocking = False
        self._host: HostNumerics | None = None
        self._subscribers: list[Callable[[HostNumerics], None]] = []

    def subscribe(self, consumer: Callable[[HostNumerics], None]) -> None:
        """Call ``consumer`` with the host values once they are read back."""
        self._subscribers.append(consumer)

    def stage(self, blocking: bool) -> None:
        if not self._staged:
            self._staged = True
            self._read_blocking = blocking
            if self.packed is not None:
                self._readback = Readback(self.packed, blocking=blocking)

    def ready(self) -> bool:
        return self._staged and (self._readback is None or self._readback.ready())

    def read(self, blocking: bool = True) -> HostNumerics:
        """Host values; with ``blocking`` a sync on CUDA if the deferred copy has not completed."""
        if self._host is None:
            self.stage(blocking)
            if self.packed is None:  # one process on the CPU
                row, values = self._cpu_parts
                offset = 0
                ranks = [rank_flags(self._host_row + row.tolist())]  # type: ignore[operator]
            elif self._host_row is not None:  # one process: the counts never left the host
                values = self._readback.tensor()
                offset = len(DEVICE_FIELDS)
                ranks = [rank_flags(self._host_row + values[:offset].tolist())]
            else:
                values = self._readback.tensor()
                width = len(RANK_FIELDS)
                offset = self.world_size * width
                rows = values[:offset].tolist()
                ranks = [rank_flags(rows[i * width:(i + 1) * width]) for i in range(self.world_size)]
            self._host = HostNumerics(
                step=self.step, ranks=ranks, index=self.index, squares=values, start=offset,
                missing_slots=self.missing_slots,
                # bound to values, not to self: the host values never hold their measurement (no reference cycle,
                # so a step's tensors are freed when the last reader drops them, not at the next garbage collection)
                scan_parameters=functools.partial(scan_parameters, self.index,
                                                  (self.flags_sum or True) if self._read_blocking and
                                                  self.world_size > 1 else False),
                read_before_update=self._read_blocking, error=self.error,
                without_gradients=self.without_gradients, steps_done=self.steps_done,
            )
        return self._host

    def deliver(self) -> None:
        """Hand the host values to every consumer; one that raises does not keep them from the others (its error is
        raised again once all had them, for the caller's guard to record)."""
        host = self.read(blocking=True)
        subscribers, self._subscribers = self._subscribers, []
        failure: Exception | None = None
        for consumer in subscribers:
            try:
                consumer(host)
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure


def scan_parameters(index: ParameterIndex, reduce_flags: bool | Callable[[torch.Tensor], torch.Tensor]
                    ) -> list[tuple[str, float]]:
    """Names and local norms of ``index``'s non-finite parameters, now (one sync; the anomaly path only).

    With ``reduce_flags`` (values read synchronously: every rank at the same point of the same step)
    the per-parameter flags are summed across processes, so every rank names the same parameters,
    sharded ones included (through ``reduce_flags`` when it is the run's gate, which sums a vector over ranks).
    A deferred read completes at different times on different GPUs, so it issues no collective.

    Example::

        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> with torch.no_grad():
        ...     _ = model.bias.fill_(float("nan"))
        >>> scan_parameters(ParameterIndex(list(model.named_parameters())), False)
        [('bias', nan)]
    """
    if not len(index):
        return []
    try:
        squares = index.plan.squares(index.local_params())
    except Exception:  # the flags still join the reduction (as finite), so no rank waits alone
        squares = torch.zeros(len(index), dtype=torch.float64, device=index.device)
    flags = (~torch.isfinite(squares)).double()
    if callable(reduce_flags):
        flags = reduce_flags(flags)
    elif reduce_flags and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags)
    bad = flags.nonzero().flatten().tolist()
    if not bad:
        return []
    norms = squares.sqrt().tolist()
    return [(index.names[i], norms[i] if not math.isfinite(norms[i]) else math.nan) for i in bad]
