"""Fused numeric health of many tensors: device tensors from a constant number of kernel launches, no host sync.

Python work per tensor on a check step grows with the model, so :class:`NormPlan` is worked out once per list of
slots. ``DTensor`` shards are measured locally; :func:`owns_block` says which ranks' blocks add up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch

from lightning_debug.checks import fused

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch < 2.4
    try:
        from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
    except ImportError:  # torch built without distributed
        DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]
try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:
    _StridedShard = Shard  # type: ignore[assignment,misc]

SMALL_NUMEL_CPU = 4096
FLAT_MIN_TENSORS = 32
ROWS_MIN_TENSORS = 8
SEGMENT_MAX_NUMEL = 1024
SEGMENT_MIN_TENSORS = 16
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_local_of = attrgetter("_local_tensor")


def is_dtensor(tensor: object) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of a ``DTensor`` (no communication, no autograd); a plain tensor as is."""
    return _local_of(tensor) if is_dtensor(tensor) else tensor


def local_tensors(tensors: Sequence[torch.Tensor], sharded: bool) -> list[torch.Tensor]:
    """:func:`local_tensor` of each; ``sharded`` says whether any of them may be a ``DTensor``."""
    return [local_tensor(t) for t in tensors] if sharded else list(tensors)


def compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (holding the original as ``_orig_mod``): a hook inside it
    would be traced by Dynamo and recompile the graph, one on the wrapper runs outside.

    >>> compiled_wrapper(torch.nn.Linear(2, 2))
    False
    """
    return isinstance(getattr(module, "_orig_mod", None), torch.nn.Module)


def user_name(name: str) -> str:
    """A parameter or module name as the user wrote the model, without the segments ``torch.compile``, FSDP1 and
    activation checkpointing insert.

    >>> user_name("model._orig_mod.inp.weight"), user_name("model._orig_mod")
    ('model.inp.weight', 'model')
    """
    if "_" not in name or not any(segment in name for segment in WRAPPER_SEGMENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def owns_block(tensor: torch.Tensor, rank: int) -> bool:
    """Whether this rank's local block counts when squared norms are summed over every process.

    Along a mesh dimension that shards a ``DTensor`` the blocks are disjoint (their squares add up); along one that
    replicates it only coordinate 0 counts; on a sub-mesh, only the copy holding global rank 0; a plain tensor
    (DDP), rank 0's. The sum over the world is then exact, with no division.

    >>> owns_block(torch.ones(2), rank=0), owns_block(torch.ones(2), rank=1)
    (True, False)
    """
    if not is_dtensor(tensor):
        return rank == 0
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    placements = tensor.placements  # type: ignore[attr-defined]
    # _StridedShard (FSDP over tensor parallel on one dim) is not a Shard subclass in torch 2.13
    return bool((mesh.mesh == 0).any()) and all(
        c == 0 for c, placement in zip(coordinate, placements) if not isinstance(placement, (Shard, _StridedShard)))


def replica_slots(tensors: Sequence[torch.Tensor], world: int, plain_sharded: bool = False) -> list[int]:
    """The slots of ``tensors`` each of ``world`` processes holds whole, which data parallelism keeps identical on
    every rank: with plain tensors only (DDP), every slot; beside ``DTensor`` s (FSDP2, tensor parallelism: no
    wrapper is known to synchronise their plain tensors), only a ``DTensor`` replicated over the whole world; none
    with one process or ``plain_sharded`` (FSDP1, DeepSpeed: plain tensors are shards).

    >>> replica_slots([torch.ones(2), torch.ones(3)], world=2), replica_slots([torch.ones(2)], world=1)
    ([0, 1], [])
    >>> replica_slots([torch.ones(2)], world=2, plain_sharded=True)
    []
    """
    if world < 2 or plain_sharded:
        return []
    if not any(is_dtensor(t) for t in tensors):
        return list(range(len(tensors)))
    return [i for i, t in enumerate(tensors) if is_dtensor(t) and _replicated_over(t, world)]


def _replicated_over(tensor: Any, world: int) -> bool:
    return tensor.device_mesh.size() == world and all(p.is_replicate() for p in tensor.placements)


def has_partial(tensor: torch.Tensor) -> bool:
    """A ``DTensor`` with pending sums (``Partial``): its local values are addends, not blocks."""
    return is_dtensor(tensor) and any(p.is_partial() for p in tensor.placements)  # type: ignore[attr-defined]


def without_partial(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its ``Partial`` mesh dimensions reduced to ``Replicate`` (one collective)."""
    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]  # type: ignore[attr-defined]
    return tensor.redistribute(tensor.device_mesh, placements)  # type: ignore[attr-defined]


def _accumulated_norms(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    # float32 accumulation for half types; float64 cannot be narrowed inside the kernel.
    return torch.stack(fused.norms(tensors, 2, None if dtype == torch.float64 else torch.float32))


def _odd(tensor: torch.Tensor) -> bool:
    return tensor.is_sparse or tensor.is_complex() or not tensor.is_floating_point()


def fused_norms(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The 2-norm of each tensor as one float32 vector: one ``torch._foreach_norm`` per device and dtype, sparse,
    complex and integer tensors one by one. A non-finite element makes its norm non-finite.

    >>> fused_norms([torch.ones(4), torch.tensor([3.0, 4.0])]).tolist()
    [2.0, 5.0]
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    results: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    with torch.no_grad():
        for index, tensor in enumerate(tensors):
            if tensor.is_sparse:
                results[index] = torch.linalg.vector_norm(tensor.coalesce().values().detach().abs().float())
            elif tensor.is_complex() or not tensor.is_floating_point():
                results[index] = torch.linalg.vector_norm(tensor.detach().abs().float())
            else:
                groups.setdefault((tensor.device, tensor.dtype), []).append(index)
        for (_, dtype), indices in groups.items():
            for index, norm in zip(indices, _accumulated_norms([tensors[i] for i in indices], dtype)):
                results[index] = norm
        return torch.stack([norm.to(device, torch.float32) for norm in results])  # type: ignore[union-attr]


class NormPlan:
    """Squared 2-norms of a fixed list of tensor slots, worked out once and reused every step.

    Built from one example per slot; :meth:`squares` returns float64 squares (a finite norm above ~1.8e19 must not
    square to Inf) with a number of operations that does not grow with the slots: one ``torch._foreach_norm`` per
    device and dtype, except that the CPU runs that kernel once per tensor, so from ``FLAT_MIN_TENSORS`` small
    tensors on they are joined: same-shape slots (the biases of repeated layers) as the rows of one matrix, the rest
    concatenated and summed per segment.

    >>> plan = NormPlan([torch.zeros(2), torch.zeros(3, 3)])
    >>> plan.squares([torch.tensor([3.0, 4.0]), torch.ones(3, 3)]).tolist()
    [25.0, 9.0]
    >>> before = plan.snapshot([torch.zeros(2), torch.zeros(3, 3)])
    >>> plan.distance_squares(before, [torch.tensor([0.0, 2.0]), torch.zeros(3, 3)]).tolist()
    [4.0, 0.0]
    """

    def __init__(self, examples: Sequence[torch.Tensor]) -> None:
        self.size = len(examples)
        self.device = examples[0].device if examples else torch.device("cpu")
        small: dict[torch.device, list[int]] = {}
        foreach: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        odd: list[int] = []
        for index, tensor in enumerate(examples):
            if _odd(tensor):
                odd.append(index)
            elif tensor.device.type == "cpu" and tensor.numel() <= SMALL_NUMEL_CPU:
                small.setdefault(tensor.device, []).append(index)
            else:
                foreach.setdefault((tensor.device, tensor.dtype), []).append(index)
        # (indices, scalars): same-shape slots measured as the rows of one matrix
        self._rows: list[tuple[list[int], bool]] = []
        # ((indices, scalars) per trailing shape, segment lengths): slots summed per segment of one buffer
        self._segments: list[tuple[list[tuple[list[int], bool]], torch.Tensor]] = []
        for device, indices in small.items():
            if len(indices) < FLAT_MIN_TENSORS:  # a few small tensors: one launch each beats joining them
                for index in indices:
                    foreach.setdefault((device, examples[index].dtype), []).append(index)
                continue
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for index in indices:
                by_shape.setdefault(tuple(examples[index].shape), []).append(index)
            by_trailing: dict[tuple[int, ...] | None, list[int]] = {}
            for shape, members in by_shape.items():
                if len(members) >= ROWS_MIN_TENSORS and math.prod(shape) > 0:
                    self._rows.append((members, not shape))
                    continue
                for index in members:
                    if examples[index].numel() > SEGMENT_MAX_NUMEL:
                        foreach.setdefault((device, examples[index].dtype), []).append(index)
                    else:  # None: 0-d, stacked
                        by_trailing.setdefault(shape[1:] if shape else None, []).append(index)
            if sum(map(len, by_trailing.values())) < SEGMENT_MIN_TENSORS:  # a few: the fused norm is cheaper
                for members in by_trailing.values():
                    for index in members:
                        foreach.setdefault((device, examples[index].dtype), []).append(index)
                by_trailing = {}
            if by_trailing:
                groups = [(members, trailing is None) for trailing, members in by_trailing.items()]
                lengths = torch.tensor([examples[i].numel() for members, _ in groups for i in members], device=device)
                self._segments.append((groups, lengths))
        for key in foreach:
            foreach[key].sort()
        self._foreach = [(indices, dtype) for (_, dtype), indices in foreach.items()]
        self._odd = odd
        self.joined = frozenset(i for indices, _ in self._rows for i in indices) | frozenset(
            i for groups, _ in self._segments for indices, _ in groups for i in indices)
        """The slots measured inside a joined block (rows, segments), where a tensor must have its slot's shape;
        any other slot takes a tensor of any shape."""
        order = [i for indices, _ in self._rows for i in indices]
        order += [i for groups, _ in self._segments for indices, _ in groups for i in indices]
        order += [i for indices, _ in self._foreach for i in indices] + odd
        blocks = len(self._rows) + sum(len(groups) for groups, _ in self._segments) + len(self._foreach) + bool(odd)
        self._whole = blocks == 1
        self._order = None if order == list(range(self.size)) else torch.tensor(
            sorted(range(self.size), key=order.__getitem__), device=self.device)
        self.fused = True

    def _pick(self, tensors: Sequence[torch.Tensor], indices: list[int]) -> Sequence[torch.Tensor]:
        return tensors if self._whole else [tensors[i] for i in indices]

    def _join(self, tensors: Sequence[torch.Tensor], indices: list[int], scalars: bool) -> torch.Tensor:
        """The slots ``indices`` (0-d ones stacked, others sharing their trailing shape) along dim 0."""
        picked = list(self._pick(tensors, indices))
        return torch.stack(picked) if scalars else torch.cat(picked)

    def _matrix(self, tensors: Sequence[torch.Tensor], indices: list[int], scalars: bool) -> torch.Tensor:
        """The same-shape slots ``indices`` as the rows of one matrix."""
        return self._join(tensors, indices, scalars).view(len(indices), -1)

    def _concat(self, tensors: Sequence[torch.Tensor], groups: list[tuple[list[int], bool]]) -> torch.Tensor:
        """The values of the slots of ``groups``, one after the other, as one 1-d tensor."""
        parts = [self._join(tensors, indices, scalars).reshape(-1) for indices, scalars in groups]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _squared_in_order(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """The blocks' norms joined, squared (float64) and put back in slot order: one operation each for all
        blocks, since right after a backward every extra operation pays for cold caches."""
        if not norms:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        if any(norm.device != self.device for norm in norms):
            norms = [norm.to(self.device) for norm in norms]
        squares = (norms[0] if len(norms) == 1 else torch.cat(norms)).double().square()
        return squares if self._order is None else squares.index_select(0, self._order)

    def _fallback(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        self.fused = False
        return fused_norms(tensors, self.device).double().square()

    @staticmethod
    def _row_norms(matrix: torch.Tensor) -> torch.Tensor:
        matrix = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
        return torch.linalg.vector_norm(matrix, dim=1)

    @staticmethod
    def _segment_norms(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.segment_reduce(values.double().square(), "sum", lengths=lengths).sqrt()

    @torch.no_grad()
    def squares(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Squared norms of ``tensors`` (one per slot, shaped like the examples), float64, slot order."""
        if not self.fused:
            return self._fallback(tensors)
        try:
            norms = [self._row_norms(self._matrix(tensors, indices, scalars)) for indices, scalars in self._rows]
            for groups, lengths in self._segments:
                norms.append(self._segment_norms(self._concat(tensors, groups), lengths))
            for indices, dtype in self._foreach:
                norms.append(_accumulated_norms(self._pick(tensors, indices), dtype))
            if self._odd:
                norms.append(fused_norms([tensors[i] for i in self._odd], self.device))
            return self._squared_in_order(norms)
        except (RuntimeError, TypeError, NotImplementedError):  # e.g. a sparse gradient: measure one by one
            return self._fallback(tensors)

    @torch.no_grad()
    def snapshot(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` (the weights before an optimizer step) for :meth:`distance_squares`."""
        if not self.fused:
            return [t.detach().clone() for t in tensors]
        copies = [self._matrix(tensors, indices, scalars) for indices, scalars in self._rows]
        copies += [self._concat(tensors, groups) for groups, _ in self._segments]
        for indices, _ in self._foreach:
            copies.extend(fused.scaled(self._pick(tensors, indices), 1.0))
        copies.extend(tensors[i].detach().clone() for i in self._odd)
        return copies

    @torch.no_grad()
    def distance_squares(self, snapshot: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``||tensors_i - snapshot_i||²`` per slot (float64, slot order): the size of a weight update."""
        if not self.fused:
            return fused_norms(fused.subtracted(tensors, snapshot), self.device).double().square()
        norms = [self._row_norms(self._matrix(tensors, indices, scalars) - before)
                 for (indices, scalars), before in zip(self._rows, snapshot)]
        position = len(self._rows)
        for groups, lengths in self._segments:
            norms.append(self._segment_norms(self._concat(tensors, groups) - snapshot[position], lengths))
            position += 1
        for indices, dtype in self._foreach:
            deltas = fused.subtracted(self._pick(tensors, indices), snapshot[position:position + len(indices)])
            norms.append(_accumulated_norms(deltas, dtype))
            position += len(indices)
        if self._odd:
            deltas = [tensors[i] - before for i, before in zip(self._odd, snapshot[position:])]
            norms.append(fused_norms(deltas, self.device))
        return self._squared_in_order(norms)


def nonfinite_named(names: Sequence[str], norms: torch.Tensor | Sequence[float]) -> list[tuple[str, float]]:
    """The ``(name, norm)`` pairs whose norm is NaN or infinite; one read-back (rare paths only).

    >>> nonfinite_named(["a", "b"], torch.tensor([1.0, float("inf")]))
    [('b', inf)]
    """
    values: Any = norms.tolist() if isinstance(norms, torch.Tensor) else norms
    return [(name, value) for name, value in zip(names, values) if not math.isfinite(value)]
