"""The trainable parameters of a model (or of one optimizer), worked out once and reused every step.

Example::

    >>> from torch import nn
    >>> len(ParameterIndex(list(nn.Linear(2, 2).named_parameters())))
    2
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import is_

import torch
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
from lightning_debug.core.numerics.owned import Owned

REQUIRES_GRAD_RECHECK = 16


def signature(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[object, ...]]:
    """What an index depends on, parameter by parameter: name, identity, ``requires_grad``, shape,
    dtype and device. Two walks of a model with equal signatures give the same index."""
    return [(name, id(p), p.requires_grad, p.shape, p.dtype, p.device) for name, p in named]


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
        """Whether this use should compare the model against :attr:`signature`, which a registration
        does not announce: a parameter's ``requires_grad`` (compared every ``REQUIRES_GRAD_RECHECK``
        uses, a list of booleans) and, every ``REQUIRES_GRAD_RECHECK ** 2`` uses, everything else
        (``.data`` replaced, a module cast in place, a parameter swapped into ``_parameters``).
        Until then a changed shape, dtype or device costs speed, not correctness: the plan falls
        back to measuring one tensor at a time."""
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

    def _zeros_for(self, slot: int) -> torch.Tensor:
        """Zeros standing for slot ``slot``'s missing gradient (read only), kept: MoE experts that got no
        token miss theirs on most steps, and a zero tensor of the expert's size costs an allocation, a
        write and a read of that size each time. One 0-d zero of the slot's dtype and device, which the
        fused norm takes whatever the slot's shape (dense, so CUDA keeps its fused kernel); a slot the
        plan joins with others (small, on a CPU) gets that zero expanded to its shape (no memory)."""
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
