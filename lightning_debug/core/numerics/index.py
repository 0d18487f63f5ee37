"""The parameters a step is measured over, built once, and the row each rank packs for the one collective.

A :class:`ParameterIndex` is rebuilt only when a registration puts a different object into a slot of a watched
module (Llama-family decoders register every layer again in each forward, so not every registration is a change).
The two registration hooks are process-wide: a run holds them by a :class:`Lease`.
    >>> lease = watch_registrations()
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> watch_model(model)
    >>> before = registration_count()
    >>> _ = nn.ModuleList(list(model))  # a fresh container: not the model
    >>> model[0] = model[0]             # the same module in the same slot
    >>> registration_count() == before
    True
    >>> model.append(nn.Linear(2, 2))
    Sequential(...)
    >>> registration_count() > before
    True
    >>> installed(), lease.held
    (True, True)
    >>> lease.release(); lease.held  # the hooks go with the last lease held in the process
    False
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import is_
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_debug.checks.numerics import (
    NormPlan,
    has_partial,
    is_dtensor,
    local_tensor,
    local_tensors,
    owns_block,
    replica_slots,
    user_name,
    without_partial,
)
from lightning_debug.core.gate import distributed
from lightning_debug.core.metrics import metric_part


# One row per rank (see ``rank_flags``); the host fields travel in the row only when a collective carries them.
HOST_FIELDS = ("loss_count", "input_count", "check_failed")
DEVICE_FIELDS = ("loss_sum", "input_low", "input_high", "grad_local_sum", "grad_square_sum", "param_local_sum",
                 "buffer_high", "batch_print")
RANK_FIELDS = HOST_FIELDS + DEVICE_FIELDS
AllGather = Callable[[torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], Any]


_constants: dict[tuple[torch.device, float | str], torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """A shared 0-d float64 tensor holding ``value`` on ``device``, created once (never written to)."""
    key = (device, value if value == value else "nan")  # NaN equals no key, not even itself
    tensor = _constants.get(key)
    if tensor is None:
        tensor = _constants[key] = torch.full((), value, dtype=torch.float64, device=device)
    return tensor


def rank_flags(row: Sequence[float]) -> dict[str, float]:
    """The flags of one rank's row (:data:`RANK_FIELDS` order): a sum that is not finite is the sign that one of its
    terms is not (float64 sums of float32 values do not overflow), so the device packs raw sums and the host tells.

        >>> flags = rank_flags([1, 0, 0, float("nan"), 0, 0, 4.0, 4.0, 0, float("inf"), float("nan")])
        >>> flags["loss_finite"], flags["input_nonfinite"], flags["grad_nonfinite"], flags["loss_value"]
        (0.0, -1.0, 0.0, nan)
        >>> flags["buffer_nonfinite"], flags["batch_print"]
        (1.0, nan)
    """
    (loss_count, input_count, failed, loss_sum, low, high, grad_local, grad_owned, param_local, buffer_high,
     batch_print) = row
    loss_finite = math.isfinite(loss_sum)
    return {"loss_finite": -1.0 if not loss_count else float(loss_finite),
            "grad_nonfinite": float(not math.isfinite(grad_local)),
            "param_nonfinite": float(not math.isfinite(param_local)),
            "buffer_nonfinite": float(not math.isfinite(buffer_high)),
            "grad_square_sum": grad_owned,
            "input_nonfinite": -1.0 if not input_count else float(not (math.isfinite(low) and math.isfinite(high))),
            "check_failed": failed,
            "loss_value": loss_sum / loss_count if loss_count and loss_finite else math.nan,
            "batch_print": batch_print}


class Owned:
    """Which slots' squares this rank adds to the sums over every process; the two common cases, every slot (one
    process) and none (a replica), are known on the host and cost no device work.

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


_registrations = [0]
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_every_module = [False]  # a model whose modules are unknown is watched: every registration counts


def registration_count() -> int:
    """Registrations that may have changed a watched model, plus one per installation of the hooks (what happened
    while none was installed was not seen)."""
    return _registrations[0]


def watch_model(model: nn.Module | None) -> None:
    """Count registrations into ``model``'s modules from now on (None: unknown, every registration counts)."""
    if model is None:
        _every_module[0] = True
    else:
        _watched.update(model.modules())


def _counter(table: str) -> Callable[[nn.Module, str, Any], None]:
    """A registration hook that counts a new object in a slot of ``module.<table>`` of a watched module."""
    def count(module: nn.Module, name: str, value: Any) -> None:
        if (_every_module[0] or module in _watched) and getattr(module, table).get(name) is not value:
            _registrations[0] += 1
    return count


_handles: list[RemovableHandle] = []
_leases: set[int] = set()  # the ids of the leases not yet released
_next_lease = [0]


def installed() -> bool:
    """Whether the two global registration hooks are installed now (a run holds a lease)."""
    return bool(_handles)


class Lease:
    """A hold on the two global hooks, let go by :meth:`release` (idempotent) or by garbage collection."""

    def __init__(self) -> None:
        _next_lease[0] += 1
        self.id = _next_lease[0]
        _leases.add(self.id)
        self._finalizer = weakref.finalize(self, _release, self.id)

    @property
    def held(self) -> bool:
        return self.id in _leases

    def release(self) -> None:
        self._finalizer()


def _release(lease_id: int) -> None:
    _leases.discard(lease_id)
    if _leases or not _handles:
        return
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _watched.clear()
    _every_module[0] = False


def watch_registrations() -> Lease:
    """Hold the two global registration hooks (installed by the first lease held)."""
    lease = Lease()
    if not _handles:
        _registrations[0] += 1  # a change made while nothing counted: every index made before is checked again
        _handles.append(nn.modules.module.register_module_parameter_registration_hook(_counter("_parameters")))
        _handles.append(nn.modules.module.register_module_module_registration_hook(_counter("_modules")))
    return lease


REQUIRES_GRAD_RECHECK = 16


def signature(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[object, ...]]:
    """What an index depends on, parameter by parameter: equal signatures give the same index."""
    return [(name, id(p), p.requires_grad, p.shape, p.dtype, p.device) for name, p in named]


class ParameterIndex:
    """The trainable parameters of a model (or of one optimizer), their user-facing names, which blocks this rank owns
    and the :class:`~lightning_debug.checks.numerics.NormPlan` of their local shards. Every rank builds the same slots
    in the same order (full shapes decide), so one all-reduce lines their values up. With ``plain_sharded`` (FSDP1,
    DeepSpeed) plain tensors are this rank's shard and no empty slot is dropped.

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> model[0].bias.requires_grad_(False)
        Parameter containing:...
        >>> ParameterIndex(list(model.named_parameters())).names
        ['0.weight', '1.weight', '1.bias']
    """

    builds = 0
    """Indexes built in this process (tests and benchmarks count re-planning with it)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], rank: int = 0, plain_sharded: bool = False) -> None:
        ParameterIndex.builds += 1
        self.signature = signature(named)
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
        self.replicas = replica_slots(self.params, distributed()[1], plain_sharded)  # held whole by every rank
        self._replica_positions: torch.Tensor | None = None
        self.plan = NormPlan(local_tensors(self.params, self.sharded))
        self.device = self.plan.device
        self.param_owner = self._owner_mask(self.params)
        self._grad_owner: Owned | None = None
        self._partial_slots: list[int] = []
        self._uses = 0
        self._tags: dict[str, list[str]] = {}
        self._zeros: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.params)

    def _owner_mask(self, tensors: Iterable[torch.Tensor | None]) -> Owned:
        def owned(tensor: torch.Tensor | None) -> bool:
            if self.plain_sharded and not is_dtensor(tensor):
                return True
            return owns_block(tensor, self.rank) if tensor is not None else self.rank == 0

        return Owned([owned(t) for t in tensors], self.device)

    def recheck_due(self) -> bool:
        """Whether this use compares the model with :attr:`signature` for what no registration announces:
        ``requires_grad`` every ``REQUIRES_GRAD_RECHECK`` uses, the rest (``.data`` replaced, a cast in place) every
        ``REQUIRES_GRAD_RECHECK ** 2``: until then a changed shape costs speed, not correctness (the plan falls back).
        """
        self._uses += 1
        if self._uses % REQUIRES_GRAD_RECHECK:
            return False
        return (self._uses % (REQUIRES_GRAD_RECHECK * REQUIRES_GRAD_RECHECK) == 0
                or [p.requires_grad for p in self.watched] != self.trainable_mask)

    def tags(self, prefix: str) -> list[str]:
        """``prefix + name`` for every parameter, built once (per-parameter scalar names)."""
        tags = self._tags.get(prefix)
        if tags is None:
            tags = self._tags[prefix] = [prefix + metric_part(name) for name in self.names]
        return tags

    def local_params(self) -> list[torch.Tensor]:
        return local_tensors(self.params, self.sharded)

    def replica_values(self, per_slot: torch.Tensor) -> torch.Tensor:
        """The values of ``per_slot`` (one per slot) at :attr:`replicas`, in one gather kernel."""
        if len(self.replicas) == len(self):
            return per_slot
        if self._replica_positions is None:
            self._replica_positions = torch.tensor(self.replicas, dtype=torch.long, device=per_slot.device)
        return per_slot.index_select(0, self._replica_positions)

    def _zeros_for(self, slot: int) -> torch.Tensor:
        """A kept zero for ``slot``'s missing gradient (MoE experts miss theirs on most steps): 0-d, which the fused
        norm takes whatever the shape, expanded (no memory) for a slot the plan joins with others."""
        zeros = self._zeros.get(slot)
        if zeros is None:
            local = local_tensor(self.params[slot])
            zeros = torch.zeros((), dtype=local.dtype, device=local.device)
            if slot in self.plan.joined:
                zeros = zeros.expand(local.shape)
            self._zeros[slot] = zeros
        return zeros

    def local_grads(self) -> tuple[list[torch.Tensor], list[int]]:
        """Each parameter's local gradient (zeros where there is none) and the slots without one."""
        grads = [p.grad for p in self.params]
        missing: list[int] = []
        if any(map(is_, grads, repeat(None))):
            missing = [i for i, grad in enumerate(grads) if grad is None]
            for i in missing:
                grads[i] = self._zeros_for(i)
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
