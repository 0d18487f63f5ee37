"""One optimizer step's measurement: what its forward showed, the fused device pass and its host values.

Example::

    >>> from torch import nn
    >>> model = nn.Linear(2, 1, bias=False)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> host = StepNumerics(0, ParameterIndex(list(model.named_parameters()))).read()
    >>> round(host.global_grad_norm, 4), host.grads_finite
    (1.4142, True)
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from functools import cached_property

import torch
import torch.distributed as dist

from lightning_debug.checks.tensors import real_values
from lightning_debug.core.numerics.index import (
    DEVICE_FIELDS,
    RANK_FIELDS,
    AllReduce,
    ParameterIndex,
    constant,
    rank_flags,
)
from lightning_debug.core.gate import distributed
from lightning_debug.core.readback import Readback


class Observed:
    """What the forward of an optimizer step showed, as device values (no sync): the sum of its micro-batch losses and
    the extremes of its batch tensors, which carry NaN/Inf through (extremes, not sums: a mask filled with
    ``torch.finfo(dtype).min`` must not overflow into a false alarm).

        >>> seen = Observed()
        >>> seen.add_loss(torch.tensor(2.0)); seen.add_loss(torch.tensor(4.0))
        >>> seen.add_inputs([torch.tensor([1.0, float("nan")])])
        >>> float(seen.loss_sum), seen.loss_count, [float(end) for end in seen.input_ends()]
        (6.0, 2, [nan, nan])
    """

    __slots__ = ("loss_sum", "loss_count", "_ends", "input_count", "buffer_high", "_losses", "batch_print")

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self._ends: list[torch.Tensor] = []
        self.input_count = 0
        self.buffer_high: torch.Tensor | None = None  # the largest magnitude over the buffers after the last forward
        self._losses: list[weakref.ref[torch.Tensor]] = []
        self.batch_print: torch.Tensor | None = None  # the step's batches, one float64 each rank compares (no sync)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss; the same tensor given again (by a second monitor) counts once.

            >>> seen, loss = Observed(), torch.tensor(3.0)
            >>> seen.add_loss(loss); seen.add_loss(loss)
            >>> seen.loss_count
            1
        """
        if any(seen() is loss for seen in self._losses):
            return
        self._losses.append(weakref.ref(loss))
        value = loss.detach().double()
        if value.dim():
            value = value.mean()
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value.to(self.loss_sum.device)
        self.loss_count += 1

    def add_batch(self, fingerprint: torch.Tensor) -> None:
        """Add a micro-batch's fingerprint (a 0-d float64 tensor) to the step's."""
        self.batch_print = fingerprint if self.batch_print is None else self.batch_print + fingerprint.to(
            self.batch_print.device)

    def add_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Floating or complex tensors (a complex one is read as its real and imaginary parts, a view)."""
        for tensor in tensors:
            self._ends.extend(torch.aminmax(real_values(tensor)))
        self.input_count += len(tensors)

    def input_ends(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The smallest and the largest value over every observed batch tensor (NaN if any holds one)."""
        ends = self._ends
        if len(ends) <= 2:
            return (ends[0], ends[1]) if ends else None
        first = ends[0]
        if not all(end.dtype == first.dtype and end.device == first.device for end in ends):
            device = next((end.device for end in ends if end.device.type != "cpu"), first.device)  # never read a GPU value
            ends = [end.to(device, torch.float64, non_blocking=True) for end in ends]
        low, high = torch.aminmax(torch.stack(ends))
        return low, high


class HostNumerics:
    """The host-side values of a :class:`StepNumerics`: per-rank flags as Python numbers, the squared norms as the
    read-back CPU vector (from ``start``: every slot's gradient, then, when measured, every parameter), turned into
    names and floats only when asked: on a CPU even slicing is an operation, which a step that names nothing skips.

        >>> from torch import nn
        >>> index = ParameterIndex(list(nn.Linear(1, 1, bias=False).named_parameters()))
        >>> host = HostNumerics(0, [rank_flags([0, 0, 0, 0.0, 0, 0, 9.0, 9.0, 0, 0, 0])], index,
        ...                     torch.tensor([9.0], dtype=torch.float64), [])
        >>> host.global_grad_norm, host.grad_norms, host.missing
        (3.0, [3.0], [])
    """

    def __init__(self, step: int, ranks: list[dict[str, float]], index: ParameterIndex, squares: torch.Tensor,
                 missing_slots: list[int],
                 scan_parameters: Callable[[], list[tuple[str, float]]] | None = None,
                 read_before_update: bool = True, error: Exception | None = None,
                 without_gradients: bool = False, steps_done: Callable[[], int] | None = None, start: int = 0,
                 replicas: Sequence[int] = ()) -> None:
        self.step = step
        self.without_gradients = without_gradients
        self.error = error
        self.ranks = ranks
        self.param_names = index.names
        self.tags = index.tags
        self._squares = squares
        self._start = start
        self._count = len(index)
        self._replicas = list(replicas)
        self._replica_width = len(self._replicas) * len(ranks)  # the last values: every rank's replica norms
        self._names = index.names
        self._missing_slots = missing_slots
        self.scan_parameters = scan_parameters
        self.read_before_update = read_before_update
        self._steps_done = steps_done
        self.params_seen_after: int | None = None  # the last update the weights nonfinite_params() saw had received

    @cached_property
    def _grad_squares(self) -> torch.Tensor:
        if self._start == 0 and self._squares.numel() == self._count:
            return self._squares
        return self._squares[self._start:self._start + self._count]

    @cached_property
    def _param_squares(self) -> torch.Tensor:
        return self._squares[self._start + self._count:self._squares.numel() - self._replica_width]

    @property
    def replica_names(self) -> list[str]:
        """The parameters every rank holds whole whose norms the ranks exchanged (empty when not measured)."""
        return [self._names[i] for i in self._replicas]

    def replica_squares(self) -> torch.Tensor:
        """Each rank's squared norm of each of :attr:`replica_names` (a CPU tensor, one row per rank)."""
        if not self._replica_width:
            return torch.zeros((len(self.ranks), 0), dtype=torch.float64)
        return self._squares[self._squares.numel() - self._replica_width:].reshape(len(self.ranks), -1)

    @property
    def loss_checked(self) -> bool:
        return all(rank["loss_finite"] >= 0 for rank in self.ranks)

    @property
    def loss_value(self) -> float:
        """The step's loss (mean over micro-batches, then ranks); NaN when none was observed or it is not finite."""
        values = [rank.get("loss_value", math.nan) for rank in self.ranks]
        if not values or not all(math.isfinite(v) for v in values):
            return math.nan
        return sum(values) / len(values)

    def _ranks_counting(self, key: str) -> list[int]:
        """The ranks whose reduced row counts something under ``key`` (a NaN/Inf count, a failure flag)."""
        return [i for i, rank in enumerate(self.ranks) if rank.get(key, 0) > 0]

    @property
    def ranks_with_nonfinite_loss(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["loss_finite"] == 0]

    @property
    def ranks_with_nonfinite_inputs(self) -> list[int]:
        return self._ranks_counting("input_nonfinite")

    @property
    def ranks_with_nonfinite_grads(self) -> list[int]:
        return self._ranks_counting("grad_nonfinite")

    @property
    def ranks_with_nonfinite_buffers(self) -> list[int]:
        return self._ranks_counting("buffer_nonfinite")

    @property
    def ranks_with_nonfinite_params(self) -> list[int]:
        return self._ranks_counting("param_nonfinite")

    @property
    def ranks_with_failed_check(self) -> list[int]:
        """Ranks whose own measurement raised: every rank learns it from the reduced rows."""
        return self._ranks_counting("check_failed")

    @property
    def failure(self) -> Exception | None:
        """Why this step's measurement is missing (None when it ran)."""
        ranks = self.ranks_with_failed_check
        if not ranks:
            return None
        where = f" on rank {', '.join(map(str, ranks))}" if len(self.ranks) > 1 else ""
        own = f" ({type(self.error).__name__}: {self.error})" if self.error is not None else ""
        return RuntimeError(f"the shared gradient pass failed{where}{own}")

    @property
    def global_grad_norm(self) -> float:
        """The 2-norm of all gradients together: each rank sent the squares of the blocks it owns."""
        if self.ranks_with_failed_check:
            return math.nan
        return math.sqrt(sum(rank["grad_square_sum"] for rank in self.ranks))

    @property
    def missing(self) -> list[str]:
        """Trainable parameters that received no gradient."""
        return [self.param_names[i] for i in self._missing_slots]

    @cached_property
    def grad_names(self) -> list[str]:
        """Names of the parameters with a gradient (``grad_norms`` in the same order)."""
        if not self._missing_slots:
            return self.param_names
        missing = set(self._missing_slots)
        return [name for i, name in enumerate(self.param_names) if i not in missing]

    @cached_property
    def _present(self) -> list[float]:
        """The squared norms of the gradients present as floats: on a CPU one read then Python costs less than the
        tensor operations it replaces (a mask, a sqrt, a max, a min)."""
        values = self._grad_squares.tolist()
        if self._missing_slots:
            missing = set(self._missing_slots)
            values = [value for i, value in enumerate(values) if i not in missing]
        return values

    @cached_property
    def grad_norms(self) -> list[float]:
        return [math.sqrt(value) for value in self._present]

    def grad_norm_extremes(self) -> tuple[float, float]:
        """The largest and the smallest gradient norm (NaN when a gradient is NaN; 0 when none)."""
        values = self._present
        if not values:
            return 0.0, 0.0
        if math.isnan(sum(values)):  # squares are >= 0: only a NaN makes their sum NaN
            return math.nan, math.nan
        return math.sqrt(max(values)), math.sqrt(min(values))

    def grad_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's gradient norm as a CPU tensor in ``param_names`` order (0 without a gradient)."""
        return self._grad_squares.sqrt()

    def param_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's norm as a CPU tensor in ``param_names`` order (empty when not measured)."""
        return self._param_squares.sqrt()

    @property
    def params_measured(self) -> bool:
        """Whether this step measured every parameter's norm (see ``with_param_norms``)."""
        return self._squares.numel() - self._replica_width > self._start + self._count

    @cached_property
    def param_norms(self) -> list[float]:
        """Every trainable parameter's norm, when this step measured them (else empty)."""
        return self._param_squares.sqrt().tolist()

    @property
    def grads_finite(self) -> bool:
        return not any(rank["grad_nonfinite"] for rank in self.ranks)

    def nonfinite_grads(self) -> list[tuple[str, float]]:
        if self.grads_finite:
            return []
        return [(n, v) for n, v in zip(self.grad_names, self.grad_norms) if not math.isfinite(v)]

    def nonfinite_params(self) -> list[tuple[str, float]]:
        """Non-finite parameters: from the step's norms when they were computed, else scanned now (a scan read a
        step late sees the weights after this step's update: :attr:`params_seen_after` says which)."""
        if not self.params_measured:
            if self.scan_parameters is None:
                return []
            self.params_seen_after = (self._steps_done() - 1 if self._steps_done is not None and
                                      not self.read_before_update else self.step - 1)
            return self.scan_parameters()
        self.params_seen_after = self.step - 1
        if not any(rank["param_nonfinite"] for rank in self.ranks):
            return []
        return [(n, v) for n, v in zip(self.param_names, self.param_norms) if not math.isfinite(v)]


class StepNumerics:
    """Device-side measurement of one optimizer step; see :mod:`lightning_debug.core.numerics`.

    ``all_reduce`` is called exactly once by every rank with a vector of the same length (None on one process);
    ``grad_scale`` is divided out on the device; without ``with_param_norms`` a non-finite weight is found by
    :func:`scan_parameters` when the anomaly check asks, so healthy steps skip a pass over the weights;
    ``with_replicas``: every rank's norm of each parameter it holds whole, in its own block of the same all-reduce
    (``replicas_diverged``). A healthy step's device work is the fused pass and three operations.
    """

    def __init__(self, step: int, index: ParameterIndex, observed: Observed | None = None,
                 all_reduce: AllReduce | None = None, grad_scale: torch.Tensor | None = None,
                 with_param_norms: bool = False,
                 gradients: tuple[list[torch.Tensor], list[int]] | None = None, with_replicas: bool = False) -> None:
        self.step = step
        self.index = index
        self.error: Exception | None = None
        loss = observed.loss_sum if observed is not None else None
        device = index.device if len(index) else loss.device if loss is not None else torch.device("cpu")
        self.with_param_norms = with_param_norms and len(index) > 0
        self.replica_slots = index.replicas if with_replicas and all_reduce is not None else []
        replica_row: torch.Tensor | None = None
        zero, nan = constant(0.0, device), constant(math.nan, device)
        host_row = [float(observed.loss_count), float(observed.input_count), 0.0] if observed is not None \
            else [0.0, 0.0, 0.0]
        try:
            grads, missing = gradients if gradients is not None else index.local_grads()
            # with plain shards a gradient missing here may live on another rank: none is reported missing
            self.missing_slots = [] if index.plain_sharded else missing
            # no gradient at all: the gradient monitor asks whether a backward ran (missing_grad) or not (not judged)
            self.without_gradients = bool(missing) and len(missing) == len(index) and not index.plain_sharded
            grad_squares = (index.plan.squares(grads) if len(index)
                            else torch.zeros(0, dtype=torch.float64, device=device))
            if grad_scale is not None:
                grad_squares = grad_squares / grad_scale.detach().to(device=device, dtype=torch.float64).square()
            grad_local = grad_squares.sum()
            grad_terms, grad_owned = index.grad_owner.terms(grad_squares, grad_local)
            pieces = [grad_terms]
            param_local = zero
            if self.with_param_norms or self.replica_slots:
                param_squares = index.plan.squares(index.local_params())
                if self.replica_slots:
                    replica_row = index.replica_values(param_squares)
                if self.with_param_norms:
                    param_local = param_squares.sum()
                    pieces.append(index.param_owner.terms(param_squares, param_local)[0])
            ends = observed.input_ends() if observed is not None else None
            low, high = ends if ends is not None else (zero, zero)
            buffers = observed.buffer_high if observed is not None else None
            batch = observed.batch_print if observed is not None else None
            values = [loss if loss is not None else nan, low, high, grad_local, grad_owned, param_local,
                      buffers if buffers is not None else zero, batch if batch is not None else nan]
            values = [value if value.device == device else value.to(device, non_blocking=True) for value in values]
        except Exception as error:  # still join the collective, flagged, so that no rank waits or decides alone
            self.error = error
            replica_row = None
            self.missing_slots = []
            self.without_gradients = False
            pieces = [torch.zeros(len(index) * (2 if self.with_param_norms else 1), dtype=torch.float64,
                                  device=device)]
            host_row = [0.0, 0.0, 1.0]
            values = [nan, zero, zero, zero, zero, zero, zero, nan]
        row = torch.stack(values)
        rank, world = distributed() if all_reduce is not None else (0, 1)
        self.world_size = world
        if world > 1:
            width, replicas = len(RANK_FIELDS), len(self.replica_slots)
            shared = world * width + sum(piece.numel() for piece in pieces)
            packed = torch.zeros(shared + world * replicas, dtype=torch.float64, device=device)
            packed[rank * width:(rank + 1) * width] = torch.cat([torch.tensor(host_row, dtype=torch.float64,
                                                                              device=device), row])
            packed[world * width:shared] = torch.cat(pieces)
            if replica_row is not None:  # zeros in the other ranks' blocks: the sum is every rank's row, exactly
                packed[shared + rank * replicas:shared + (rank + 1) * replicas] = replica_row
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
        self.steps_done: Callable[[], int] | None = None  # set by NumericsQueue: which update a late scan sees
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
                replicas=self.replica_slots if self._host_row is None else (),
            )
        return self._host

    def deliver(self) -> None:
        """Hand the host values to every consumer; one that raises does not keep them from the others (its error is
        raised once all had them)."""
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
    """Names and local norms of ``index``'s non-finite parameters, now (one sync; the anomaly path only). With
    ``reduce_flags`` (a synchronous read: every rank at the same point) the flags are summed over ranks (through it
    when callable), so every rank names the same parameters; a deferred read issues no collective.

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
