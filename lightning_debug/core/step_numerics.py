"""Loss, gradient and parameter health of one optimizer step, computed once for every check.

The anomaly and gradient checks both need gradient norms; computing them twice would double the
cost. :class:`StepNumerics` does one fused pass, packs everything (per-rank flags included) into
one device vector, reduces it across processes with one collective, and reads it back to the host
at most once, now or a step later.

What does not change from step to step is worked out once: :class:`ParameterIndex` holds the
trainable parameters, their names and the fused-norm plan, and is rebuilt only when a parameter
or module is registered anywhere (global registration hooks bump a counter) or when a
parameter's ``requires_grad`` changes. So a healthy check step does no Python work per parameter
beyond collecting the gradients, and names are looked up only when something is found.

Sharded parameters (``DTensor``: FSDP2, tensor parallel) are measured on their local shards; each
rank contributes the squares of the blocks it owns (:func:`~lightning_debug.checks.numerics.owns_block`),
so the one all-reduce that carries every rank's flags also yields exact full-parameter norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from itertools import repeat
from operator import is_
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_debug.checks.numerics import (
    NormPlan,
    has_partial,
    is_dtensor,
    local_tensor,
    local_tensors,
    owns_block,
    user_name,
    without_partial,
)
from lightning_debug.core.metrics import metric_part
from lightning_debug.core.readback import Readback

# One row per rank, raw values whose finiteness is the flag (the host derives the flags, see
# ``rank_flags``); the packing follows this list. The counts and ``check_failed`` are Python numbers,
# which travel in the row only when there is a collective to carry them.
HOST_FIELDS = ("loss_count", "input_count", "check_failed")
DEVICE_FIELDS = ("loss_sum", "input_low", "input_high", "grad_local_sum", "grad_square_sum", "param_local_sum")
RANK_FIELDS = HOST_FIELDS + DEVICE_FIELDS
MAX_PENDING_READBACKS = 4
REQUIRES_GRAD_RECHECK = 16
AllGather = Callable[[torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], Any]

_registrations = [0]


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    """Count every parameter and submodule registered in this process (once per process)."""
    if _registrations[0] == 0:
        _registrations[0] = 1
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        nn.modules.module.register_module_module_registration_hook(_count_registration)


_constants: dict[tuple[torch.device, str], torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """A shared 0-d float64 tensor holding ``value`` on ``device``, created once (never written to)."""
    key = (device, str(value))
    tensor = _constants.get(key)
    if tensor is None:
        tensor = _constants[key] = torch.full((), value, dtype=torch.float64, device=device)
    return tensor


def rank_flags(row: Sequence[float]) -> dict[str, float]:
    """The flags of one rank's row (:data:`RANK_FIELDS` order): a sum that is not finite is the sign
    that one of its terms is not (NaN and infinities propagate; float64 sums of float32 values do not
    overflow), so the device packs raw sums and the host tells.

    Example::

        >>> flags = rank_flags([1, 0, 0, float("nan"), 0, 0, 4.0, 4.0, 0])
        >>> flags["loss_finite"], flags["input_nonfinite"], flags["grad_nonfinite"], flags["loss_value"]
        (0.0, -1.0, 0.0, nan)
    """
    loss_count, input_count, failed, loss_sum, low, high, grad_local, grad_owned, param_local = row
    loss_finite = math.isfinite(loss_sum)
    return {"loss_finite": -1.0 if not loss_count else float(loss_finite),
            "grad_nonfinite": float(not math.isfinite(grad_local)),
            "param_nonfinite": float(not math.isfinite(param_local)),
            "grad_square_sum": grad_owned,
            "input_nonfinite": -1.0 if not input_count else float(not (math.isfinite(low) and math.isfinite(high))),
            "check_failed": failed,
            "loss_value": loss_sum / loss_count if loss_count and loss_finite else math.nan}


def world_position() -> tuple[int, int]:
    """This process's rank and the number of processes of the default (WORLD) group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Owned:
    """Which slots' squares this rank adds to the sums over every process (see
    :func:`~lightning_debug.checks.numerics.owns_block`), with the two common cases, every slot (one
    process) and none (a replica), known on the host so that they cost no device work.

    Example::

        >>> squares = torch.tensor([1.0, 4.0], dtype=torch.float64)
        >>> terms, total = Owned([True, False], squares.device).terms(squares, squares.sum())
        >>> terms.tolist(), float(total)
        ([1.0, 0.0], 1.0)
    """

    def __init__(self, owned: list[bool], device: torch.device) -> None:
        self.mask = torch.tensor(owned, dtype=torch.bool, device=device)
        self.every = all(owned)
        self.none = bool(owned) and not any(owned)

    def terms(self, squares: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned part of ``squares`` (zeros elsewhere) and its sum, given ``total``, the sum of all."""
        if self.every:
            return squares, total
        zero = constant(0.0, squares.device)
        if self.none:
            return torch.zeros_like(squares), zero
        terms = torch.where(self.mask, squares, zero)
        return terms, terms.sum()


class ParameterIndex:
    """The trainable parameters of a model (or of one optimizer), built once and reused every step.

    Holds the parameters in ``named_parameters`` order, their user-facing names (see
    :func:`~lightning_debug.checks.numerics.user_name`), which are sharded, which blocks this rank
    owns and the :class:`~lightning_debug.checks.numerics.NormPlan` of their local shards. Every
    rank builds the same slots in the same order (full shapes decide, not local ones), which is
    what lets one all-reduce line their values up. With ``plain_sharded`` (FSDP1 flat parameters,
    DeepSpeed) plain tensors are this rank's shard: every rank's block counts, and no slot is
    dropped for being empty here, since another rank may hold its elements.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> model[0].bias.requires_grad_(False)
        Parameter containing:...
        >>> index = ParameterIndex(list(model.named_parameters()))
        >>> index.names
        ['0.weight', '1.weight', '1.bias']
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], rank: int = 0, plain_sharded: bool = False) -> None:
        everything = [(name, p) for name, p in named if plain_sharded or p.numel() > 0]
        self.watched = [p for _, p in everything]
        self.trainable_mask = [p.requires_grad for p in self.watched]
        trainable = [(user_name(name), p) for (name, p), keep in zip(everything, self.trainable_mask) if keep]
        self.names = [name for name, _ in trainable]
        self.params = [p for _, p in trainable]
        self.rank = rank
        self.plain_sharded = plain_sharded
        self.sharded = plain_sharded or any(is_dtensor(p) for p in self.params)
        self.sharded_names = [name for name, p in trainable if plain_sharded or is_dtensor(p)]
        self.plan = NormPlan(local_tensors(self.params, self.sharded))
        self.device = self.plan.device
        self.param_owner = self._owner_mask(self.params)
        self._grad_owner: Owned | None = None
        self._partial_slots: list[int] = []
        self._uses = 0
        self._tags: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self.params)

    def _owner_mask(self, tensors: Iterable[torch.Tensor | None]) -> Owned:
        def owned(tensor: torch.Tensor | None) -> bool:
            if self.plain_sharded and not is_dtensor(tensor):
                return True
            return owns_block(tensor, self.rank) if tensor is not None else self.rank == 0

        return Owned([owned(t) for t in tensors], self.device)

    def current(self) -> bool:
        """Whether no parameter's ``requires_grad`` changed (checked every few uses: cheap, not free)."""
        self._uses += 1
        if self._uses % REQUIRES_GRAD_RECHECK:
            return True
        return [p.requires_grad for p in self.watched] == self.trainable_mask

    def tags(self, prefix: str) -> list[str]:
        """``prefix + name`` for every parameter, built once (per-parameter scalar names)."""
        tags = self._tags.get(prefix)
        if tags is None:
            tags = self._tags[prefix] = [prefix + metric_part(name) for name in self.names]
        return tags

    def local_params(self) -> list[torch.Tensor]:
        return local_tensors(self.params, self.sharded)

    def local_grads(self) -> tuple[list[torch.Tensor], list[int]]:
        """Each parameter's local gradient (zeros where there is none) and the slots without one."""
        grads = [p.grad for p in self.params]
        missing: list[int] = []
        if any(map(is_, grads, repeat(None))):
            missing = [i for i, grad in enumerate(grads) if grad is None]
            for i in missing:
                grads[i] = torch.zeros_like(local_tensor(self.params[i]))
        if self.sharded:  # DTensor locals, Partial placements (plain shards pass through unchanged)
            if self._grad_owner is None:  # gradients are laid out like their parameters, except Partial ones
                absent = set(missing)
                layout = [self.params[i] if i in absent else g for i, g in enumerate(grads)]
                self._partial_slots = [i for i, g in enumerate(layout) if has_partial(g)]
                self._grad_owner = self._owner_mask(without_partial(g) if has_partial(g) else g for g in layout)
            for i in self._partial_slots:
                if i not in missing:
                    grads[i] = without_partial(grads[i])  # type: ignore[arg-type]
            grads = local_tensors(grads, True)  # type: ignore[arg-type]
        return grads, missing  # type: ignore[return-value]

    @property
    def grad_owner(self) -> Owned:
        return self._grad_owner if self._grad_owner is not None else self.param_owner


class HostNumerics:
    """The host-side values of a :class:`StepNumerics`: per-rank flags as Python numbers, the
    per-parameter squared norms as CPU tensors, turned into names and Python floats only when asked
    (that is, when something was found or per-parameter scalars are logged)."""

    def __init__(self, step: int, ranks: list[dict[str, float]], index: ParameterIndex, grad_squares: torch.Tensor,
                 param_squares: torch.Tensor, missing_slots: list[int],
                 scan_parameters: Callable[[], list[tuple[str, float]]] | None = None,
                 read_before_update: bool = True, error: Exception | None = None,
                 without_gradients: bool = False, steps_done: Callable[[], int] | None = None) -> None:
        self.step = step
        self.without_gradients = without_gradients
        self.error = error
        self.ranks = ranks
        self.param_names = index.names
        self.tags = index.tags
        self._grad_squares = grad_squares
        self._param_squares = param_squares
        self._missing_slots = missing_slots
        self.scan_parameters = scan_parameters
        self.read_before_update = read_before_update
        self._steps_done = steps_done
        # The last optimizer step whose update the parameters seen by nonfinite_params() had received.
        self.params_seen_after: int | None = None

    @property
    def loss_checked(self) -> bool:
        return all(rank["loss_finite"] >= 0 for rank in self.ranks)

    @property
    def loss_value(self) -> float:
        """The step's loss (mean over micro-batches, then over the ranks that measured one); NaN when no
        loss was observed or it is not finite. Read with the flags, so it costs no sync of its own."""
        values = [rank.get("loss_value", math.nan) for rank in self.ranks]
        if not values or not all(math.isfinite(v) for v in values):
            return math.nan
        return sum(values) / len(values)

    @property
    def ranks_with_nonfinite_loss(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["loss_finite"] == 0]

    @property
    def ranks_with_nonfinite_inputs(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["input_nonfinite"] > 0]

    @property
    def ranks_with_nonfinite_grads(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["grad_nonfinite"] > 0]

    @property
    def ranks_with_nonfinite_params(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["param_nonfinite"] > 0]

    @property
    def ranks_with_failed_check(self) -> list[int]:
        """Ranks whose own measurement raised: every rank learns it from the reduced rows, in the same step."""
        return [i for i, rank in enumerate(self.ranks) if rank["check_failed"] > 0]

    @property
    def failure(self) -> Exception | None:
        """Why this step's measurement is missing: this rank's own error, or which rank failed (None when it ran)."""
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
    def _present_squares(self) -> torch.Tensor:
        squares = self._grad_squares
        if self._missing_slots:
            keep = torch.ones(squares.numel(), dtype=torch.bool)
            keep[self._missing_slots] = False
            squares = squares[keep]
        return squares

    @cached_property
    def grad_norms(self) -> list[float]:
        return self._present_squares.sqrt().tolist()

    def grad_norm_extremes(self) -> tuple[float, float]:
        """The largest and the smallest gradient norm (NaN when a gradient is not finite; 0 when none)."""
        squares = self._present_squares
        if not squares.numel():
            return 0.0, 0.0
        return math.sqrt(squares.max()), math.sqrt(squares.min())

    def grad_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's gradient norm as a CPU tensor in ``param_names`` order (0 without a gradient)."""
        return self._grad_squares.sqrt()

    def param_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's norm as a CPU tensor in ``param_names`` order (empty when not measured)."""
        return self._param_squares.sqrt()

    @property
    def params_measured(self) -> bool:
        """Whether this step measured every parameter's norm (see ``with_param_norms``)."""
        return self._param_squares.numel() > 0

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
        """Non-finite parameters: from the step's norms when they were computed, else scanned now.

        :attr:`params_seen_after` says which weights these are: a scan now, read a step late, sees the
        weights after this step's update (and any update since); the step's own norms, or a scan
        read synchronously, the weights its forward used.
        """
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


class Observed:
    """What the forward of an optimizer step showed before its gradients existed, as device values
    (no sync): the sum of its micro-batch losses, and the extremes of its batches' floating tensors.

    Sums and extremes carry NaN/Inf through, so one value per quantity is all the step needs; the
    host tells finiteness after the read-back (:func:`rank_flags`). Extremes, not sums, for the
    batches: a mask filled with ``torch.finfo(dtype).min`` is finite and must not overflow into a
    false alarm.

    Example::

        >>> seen = Observed()
        >>> seen.add_loss(torch.tensor(2.0)); seen.add_loss(torch.tensor(4.0))
        >>> seen.add_inputs([torch.tensor([1.0, float("nan")])])
        >>> float(seen.loss_sum), seen.loss_count, [float(end) for end in seen.input_ends()]
        (6.0, 2, [nan, nan])
    """

    __slots__ = ("loss_sum", "loss_count", "_ends", "input_count")

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self._ends: list[torch.Tensor] = []
        self.input_count = 0

    def add_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().double()
        if value.dim():
            value = value.mean()
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value.to(self.loss_sum.device)
        self.loss_count += 1

    def add_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            self._ends.extend(torch.aminmax(tensor.detach()))
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


class StepNumerics:
    """Device-side measurement of one optimizer step; see the module docstring.

    Args:
        step: The optimizer step measured.
        index: The parameters to measure (see :class:`ParameterIndex`).
        observed: The step's losses and batches (:class:`Observed`), or None when nobody looked.
        all_reduce: Sums a float64 vector over every process in place (the WORLD group); None on
            one process. Called exactly once, by every rank, with a vector of the same length.
        grad_scale: The loss scale still applied to the gradients (fp16 GradScaler before unscaling,
            as in an Accelerate loop right after backward): norms are divided by it on the device.
        with_param_norms: Also compute every parameter's norm (for weight norms and update ratios).
            Without it, parameters are scanned only when asked (:meth:`scan_parameters`), which the
            anomaly check does when the loss or gradients are non-finite: a non-finite weight shows
            up there on the next forward, so healthy steps skip a full pass over the weights.
        gradients: ``index.local_grads()`` when the caller already collected them.

    The device work of a healthy step is the fused norm pass and three operations (a sum, the
    stack of the row, the concatenation), whatever the number of parameters.
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
            values = [loss if loss is not None else nan, low, high, grad_local, grad_owned, param_local]
            values = [value if value.device == device else value.to(device, non_blocking=True) for value in values]
        except Exception as error:  # still join the collective, flagged, so that no rank waits or decides alone
            self.error = error
            self.missing_slots = []
            self.without_gradients = False
            pieces = [torch.zeros(len(index) * (2 if self.with_param_norms else 1), dtype=torch.float64,
                                  device=device)]
            host_row = [0.0, 0.0, 1.0]
            values = [nan, zero, zero, zero, zero, zero]
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
        else:
            self.packed = torch.cat([row, *pieces])
            self._host_row = host_row
        # How many optimizer steps have been taken by now (set by NumericsQueue): which update a late scan sees.
        self.steps_done: Callable[[], int] | None = None
        self._readback: Readback | None = None
        self._read_blocking = False
        self._host: HostNumerics | None = None
        self._subscribers: list[Callable[[HostNumerics], None]] = []

    def scan_parameters(self) -> list[tuple[str, float]]:
        """Names and local norms of the non-finite parameters, now (one sync; the anomaly path only).

        When the values were read synchronously (every rank at the same point of the same step),
        the per-parameter flags are summed across processes, so every rank names the same
        parameters, sharded ones included. A deferred read completes at different times on
        different GPUs, so it issues no collective.
        """
        index = self.index
        if not len(index):
            return []
        try:
            squares = index.plan.squares(index.local_params())
        except Exception:  # the flags still join the reduction (as finite), so no rank waits alone
            squares = torch.zeros(len(index), dtype=torch.float64, device=index.device)
        flags = (~torch.isfinite(squares)).double()
        if self._read_blocking and self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags)
        bad = flags.nonzero().flatten().tolist()
        if not bad:
            return []
        norms = squares.sqrt().tolist()
        return [(index.names[i], norms[i] if not math.isfinite(norms[i]) else math.nan) for i in bad]

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
            values = self._readback.tensor()
            if self._host_row is not None:  # one process: the counts never left the host
                offset = len(DEVICE_FIELDS)
                ranks = [rank_flags(self._host_row + values[:offset].tolist())]
            else:
                width = len(RANK_FIELDS)
                offset = self.world_size * width
                rows = values[:offset].tolist()
                ranks = [rank_flags(rows[i * width:(i + 1) * width]) for i in range(self.world_size)]
            count = len(self.index)
            self._host = HostNumerics(
                step=self.step, ranks=ranks, index=self.index, grad_squares=values[offset:offset + count],
                param_squares=values[offset + count:], missing_slots=self.missing_slots,
                scan_parameters=self.scan_parameters, read_before_update=self._read_blocking, error=self.error,
                without_gradients=self.without_gradients, steps_done=self.steps_done,
            )
        return self._host

    def deliver(self) -> None:
        host = self.read(blocking=True)
        subscribers, self._subscribers = self._subscribers, []
        for consumer in subscribers:
            consumer(host)


class NumericsQueue:
    """The current step's :class:`StepNumerics`, computed by the first check that asks and shared by
    the rest, the parameter indexes they are computed over, and the steps still waiting for their
    values to reach the host.

    Deferred reads are bounded: past ``max_pending`` waiting steps the oldest is read with a sync.
    """

    def __init__(self, max_pending: int = MAX_PENDING_READBACKS) -> None:
        self.max_pending = max_pending
        # Checks that need every weight's norm on their steps (weight logging, update ratios).
        self.param_norms_wanted: list[Callable[[int], bool]] = []
        # Optimizer steps taken so far (the run sets it after each step): which update a late parameter scan sees.
        self.steps_done = 0
        self._observed: tuple[int, Observed] | None = None
        self._current: StepNumerics | None = None
        self._pending: list[StepNumerics] = []
        self._indexes: dict[Any, tuple[Any, ParameterIndex]] = {}
        # With several optimizers (set by the run): how many steps the optimizer being stepped took before
        # this one, which is what the per-optimizer-step checks count their frequencies in; else None.
        self.optimizer_step: int | None = None
        self.several_optimizers = False
        _watch_registrations()

    def observed(self, step: int) -> Observed:
        """What has been observed of optimizer step ``step`` so far (an earlier step's is dropped)."""
        if self._observed is None or self._observed[0] != step:
            self._observed = (step, Observed())
        return self._observed[1]

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """Add a micro-batch loss to this optimizer step's (no sync)."""
        self.observed(step).add_loss(loss)

    def observe_inputs(self, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Add a micro-batch's floating batch tensors to this step's NaN/Inf test (one ``aminmax`` each, no sync)."""
        self.observed(step).add_inputs(tensors)

    def index(self, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]],
              optimizer: Any = None, rebuild: bool = False, plain_sharded: bool = False) -> ParameterIndex:
        """The :class:`ParameterIndex` of the model, or of the parameters ``optimizer`` owns (its
        param groups, in their order) when given; cached, and rebuilt only when they changed.

        The model's index is keyed by the process-wide count of parameter and module
        registrations; an optimizer's by the optimizer itself, that count and the sizes of its
        param groups (``add_param_group`` rebuilds it), so a check step does no work per parameter
        to find it.
        """
        generation: Any = _registrations[0]
        if optimizer is None:
            key: Any = ("model", plain_sharded)
        else:
            key = ("optimizer", id(optimizer), plain_sharded)
            generation = (generation, optimizer, tuple(len(group["params"]) for group in optimizer.param_groups))
        cached = self._indexes.get(key)
        if not rebuild and cached is not None and cached[0] == generation and cached[1].current():
            return cached[1]
        named = list(named_parameters())
        if optimizer is not None:
            position = {id(p): name for name, p in named}
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            named = [(position.get(id(p), f"parameter {i}"), p) for i, p in enumerate(owned)]
        if len(self._indexes) > 8:
            self._indexes.clear()
        index = ParameterIndex(named, world_position()[0], plain_sharded)
        self._indexes[key] = (generation, index)
        return index

    def scheduled_step(self, step: int) -> int:
        """The step a per-optimizer-step check's frequency counts: ``step`` itself, or, with several
        optimizers, how many steps the optimizer being stepped has taken before this one."""
        return step if self.optimizer_step is None else self.optimizer_step

    def get(self, step: int, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]],
            all_reduce: AllReduce | None, grad_scale: torch.Tensor | None = None,
            optimizer: Any = None, plain_sharded: bool = False) -> StepNumerics:
        """This step's :class:`StepNumerics` (one fused pass, one collective, whoever asks first).

        ``optimizer``: measure only the parameters it owns (several optimizers: each optimizer step
        is judged on its own parameters) instead of the model's.
        ``plain_sharded``: plain parameters are per-rank shards (see :class:`ParameterIndex`).
        """
        if self._current is None or self._current.step != step:
            index = self.index(named_parameters, optimizer, plain_sharded=plain_sharded)
            gradients: tuple[list[torch.Tensor], list[int]] | None = None
            try:  # a failure here is flagged inside StepNumerics, which still joins the collective
                gradients = index.local_grads()
                if gradients[1] and not all(index.params[i].requires_grad for i in gradients[1]):  # frozen since built
                    index = self.index(named_parameters, optimizer, rebuild=True, plain_sharded=plain_sharded)
                    gradients = index.local_grads()
            except Exception:
                gradients = None
            wanted = any(wants(step) for wants in self.param_norms_wanted)
            observed = self._observed[1] if self._observed is not None and self._observed[0] == step else None
            self._observed = None
            self._current = StepNumerics(step, index, observed, all_reduce, grad_scale, wanted, gradients)
            self._current.steps_done = lambda: self.steps_done
            self._pending.append(self._current)
        return self._current

    def poll(self, final: bool = False) -> None:
        """Stage pending measurements for read-back and deliver those whose copy has completed."""
        for numerics in self._pending:
            numerics.stage(blocking=False)
        while self._pending and (final or self._pending[0].ready() or len(self._pending) > self.max_pending):
            self._pending.pop(0).deliver()

    @property
    def pending(self) -> bool:
        """Whether a measurement waits for its values to reach the host."""
        return bool(self._pending)

    @property
    def oldest_pending_step(self) -> int | None:
        return self._pending[0].step if self._pending else None
