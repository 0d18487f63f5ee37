"""A census of live tensors: what a suspected leak keeps alive, and the sentence that names it. One pass over every
object the garbage collector tracks, so taken only to confirm a suspected leak and after an OOM.

>>> census = take_census([torch.zeros(4), torch.zeros(4), torch.zeros(2, 2)])
>>> census.tensors, census.bytes, census.largest(1)[0]["count"]
(3, 48, 2)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import torch

from lightning_debug.checks.memory.readings import MB, shape_text

CensusKey = tuple[tuple[int, ...], str, str, str]  # shape, dtype, device, grad_fn class name ("" for none)
GRAPHS_MEASURED_PER_GROUP = 8
STEADY_PER_STEP = 0.5  # a group growing by at least a tensor every two steps grows with the steps


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector tracks (not those held only inside C++, such as the activations an
    autograd graph saved), filtered in C; drop the list soon."""
    objects = gc.get_objects()
    kinds = {torch.Tensor}
    pending = [torch.Tensor]
    while pending:
        for kind in pending.pop().__subclasses__():
            if kind not in kinds:
                kinds.add(kind)
                pending.append(kind)
    try:
        return list(compress(objects, map(kinds.__contains__, map(type, objects))))
    finally:
        del objects


def graph_reach(grad_fn: Any, limit: int = 100_000) -> set[Any]:
    """The autograd nodes reachable from ``grad_fn`` (at most about ``limit``): what one kept output keeps alive (its
    size is the census's ``graph_nodes``). PyTorch hands out one Python object per live node, so the sets of several
    outputs unite by identity: nodes they share (the weights' ``AccumulateGrad``) count once.

    >>> weight = torch.ones(3, requires_grad=True)
    >>> first, second = graph_reach((weight * 2).sum().grad_fn), graph_reach((weight * 3).sum().grad_fn)
    >>> len(first), len(second), len(first | second)
    (3, 3, 5)
    """
    seen = {grad_fn}
    pending = [grad_fn]
    while pending and len(seen) < limit:
        node = pending.pop()
        for following, _ in getattr(node, "next_functions", ()):
            if following is not None and following not in seen:
                seen.add(following)
                pending.append(following)
    return seen


@dataclass
class Census:
    """Live tensors grouped by (shape, dtype, device, grad_fn): count and bytes per group; ``graph_nodes``, the
    largest autograd graph among a group's first few members (:data:`GRAPHS_MEASURED_PER_GROUP`), and
    ``graph_held``, the autograd nodes those members keep alive together. A growing graph shows in the second even
    when a member with a bigger, unchanging graph sets the first (a running total beside the one of a fit before)."""

    groups: dict[CensusKey, list[int]] = field(default_factory=dict)
    graph_nodes: dict[CensusKey, int] = field(default_factory=dict)
    seconds: float = 0.0
    graph_held: dict[CensusKey, int] = field(default_factory=dict)

    def graphs_measured(self, key: CensusKey) -> int:
        """How many members of the group ``key`` had their graph measured (0 for a group without a graph)."""
        return min(self.groups.get(key, (0, 0))[0], GRAPHS_MEASURED_PER_GROUP) if key[3] else 0

    @property
    def tensors(self) -> int:
        return sum(count for count, _ in self.groups.values())

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.groups.values())

    def largest(self, limit: int = 10) -> list[dict[str, Any]]:
        """The groups holding the most bytes, largest first."""
        ordered = sorted(self.groups.items(), key=lambda item: -item[1][1])[:limit]
        return [{"shape": list(shape), "dtype": dtype, "device": device, "grad_fn": grad_fn or None, "count": count,
                 "mb": size / MB} for (shape, dtype, device, grad_fn), (count, size) in ordered]


def take_census(tensors: Sequence[torch.Tensor] | None = None) -> Census:
    """The census of ``tensors`` (by default every live tensor), from their metadata only: no device sync."""
    started = time.perf_counter()
    census = Census()
    items = live_tensors() if tensors is None else tensors
    held: dict[CensusKey, set[Any]] = {}
    try:
        for tensor in items:
            try:
                grad_fn = tensor.grad_fn
                key: CensusKey = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), str(tensor.device),
                                  type(grad_fn).__name__ if grad_fn is not None else "")
                size = tensor.element_size() * tensor.numel()
            except Exception:  # exotic subclasses (nested, fake, functional) may refuse metadata calls
                continue
            entry = census.groups.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += size
            if grad_fn is not None and entry[0] <= GRAPHS_MEASURED_PER_GROUP:
                nodes = graph_reach(grad_fn)
                census.graph_nodes[key] = max(census.graph_nodes.get(key, 0), len(nodes))
                held.setdefault(key, set()).update(nodes)
        census.graph_held = {key: len(nodes) for key, nodes in held.items()}
    finally:
        del items, held
    census.seconds = time.perf_counter() - started
    return census


@dataclass(frozen=True)
class GroupGrowth:
    """A census group that gained tensors between two censuses ``steps`` apart."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    grad_fn: str
    added: int
    added_bytes: int
    per_step: float
    graph_nodes: int

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device,
                "grad_fn": self.grad_fn or None, "added": self.added, "added_mb": self.added_bytes / MB,
                "per_step": round(self.per_step, 3), "graph_nodes": self.graph_nodes}


def growth_rank(group: GroupGrowth) -> tuple[bool, bool, int, int]:
    """Sort key, most likely cause first: steadily growing groups with an autograd graph (a kept graph keeps its
    saved tensors alive, so the graph-less groups growing beside it are its consequence), then by bytes."""
    steady = group.added >= 2 and group.per_step >= STEADY_PER_STEP
    return (not (steady and bool(group.grad_fn)), not steady, -group.added_bytes, -group.added)


def census_growth(before: Census, after: Census, steps: int) -> list[GroupGrowth]:
    """Groups with more tensors in ``after`` than in ``before``, most likely cause first (:func:`growth_rank`).

    Example: the loss kept with its graph leads, although the batch targets its graph saved are
    more tensors and more bytes::

        >>> weight = torch.ones(3, requires_grad=True)
        >>> before = take_census([weight])
        >>> kept = [(weight * torch.ones(32, 3)).sum() for _ in range(10)] + [torch.ones(32) for _ in range(20)]
        >>> [(g.grad_fn, g.added) for g in census_growth(before, take_census([weight, *kept]), 10)]
        [('SumBackward0', 10), ('', 20)]
    """
    grown = []
    for key, (count, size) in after.groups.items():
        old_count, old_size = before.groups.get(key, (0, 0))
        if count > old_count:
            shape, dtype, device, grad_fn = key
            grown.append(GroupGrowth(shape, dtype, device, grad_fn, count - old_count, size - old_size,
                                     (count - old_count) / max(steps, 1), after.graph_nodes.get(key, 0)))
    return sorted(grown, key=growth_rank)


@dataclass(frozen=True)
class GraphGrowth:
    """A census group whose autograd graph grew between two censuses (a running total): the largest graph of one
    member (``tensors`` 1), or the nodes the group's ``tensors`` measured members keep alive together."""

    shape: tuple[int, ...]
    grad_fn: str
    nodes_before: int
    nodes_after: int
    tensors: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "grad_fn": self.grad_fn, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "tensors": self.tensors}


def graph_growth(before: Census, after: Census, steps: int) -> list[GraphGrowth]:
    """Groups whose autograd graph gained a node per step: ``total = total + loss`` keeps every step's graph while
    the number of tensors stays the same. The largest graph of a group tells when one member's graph outgrew the
    rest; the nodes its measured members hold together tell beside a bigger graph that does not change (a running
    total of a fit before), compared only when as many members were measured (more members hold more nodes).

    >>> weight = torch.ones(3, requires_grad=True)
    >>> stale, total = torch.zeros(()) + (weight * 2).sum(), torch.zeros(()) + (weight * 2).sum()
    >>> for _ in range(30):
    ...     stale = stale + (weight * 2).sum()
    >>> before = take_census([stale, total])
    >>> for _ in range(10):
    ...     total = total + (weight * 2).sum()
    >>> after = take_census([stale, total])
    >>> after.graph_nodes == before.graph_nodes  # the largest graph, the stale total's, did not change
    True
    >>> graph_growth(before, after, 10)
    [GraphGrowth(shape=(), grad_fn='AddBackward0', nodes_before=97, nodes_after=127, tensors=2)]
    """
    grown = []
    need = max(steps, 2)
    for key, nodes in after.graph_nodes.items():
        old = before.graph_nodes.get(key)
        if old is None:
            continue
        held, old_held = after.graph_held.get(key, 0), before.graph_held.get(key, 0)
        measured = after.graphs_measured(key)
        if nodes - old >= need:
            grown.append(GraphGrowth(key[0], key[3], old, nodes))
        elif measured > 1 and measured == before.graphs_measured(key) and held - old_held >= need:
            grown.append(GraphGrowth(key[0], key[3], old_held, held, measured))
    return sorted(grown, key=lambda graph: graph.nodes_before - graph.nodes_after)


def explain_growth(grown: Sequence[GroupGrowth], steps: int, graphs: Sequence[GraphGrowth] = ()) -> str:
    """The cause sentence of a ``memory_growth`` event, from a census diff over ``steps`` steps.

    >>> group = GroupGrowth((), "float32", "cpu", "NllLossBackward0", 50, 200, 1.0, 9)
    >>> explain_growth([group], 50)[:71]
    '~1 tensor/step with grad_fn NllLossBackward0 (shape [], float32 on cpu)'
    """
    growing = [group for group in grown if group.added >= 2]
    running = ""
    if graphs:
        graph = graphs[0]
        kept = f"{shape_text(graph.shape)} with grad_fn {graph.grad_fn}"
        carry = (f"A tensor {kept} carries an autograd graph that grew" if graph.tensors == 1 else
                 f"{graph.tensors} tensors {kept} carry autograd graphs that together grew")
        running = (f"{carry} from {graph.nodes_before} to {graph.nodes_after} nodes in {steps} steps: a running total "
                   "keeps every step's graph (e.g. self.total_loss += loss); accumulate loss.item() or loss.detach() "
                   "instead.")
        if not growing:
            return running
        running = " " + running
    if not growing:
        return (f"No group of live tensors grew over the last {steps} steps, so the growth is outside tensors "
                "reachable from Python: Python objects kept per step (lists, dicts, caches), memory held by C "
                "extensions, or tensors kept only inside C++. Trace it with tracemalloc or, on CUDA, "
                "torch.cuda.memory._record_memory_history.")
    top = growing[0]
    plural = top.per_step >= 1.5
    rate = f"~{top.per_step:.2g} tensor{'s' if plural else ''}/step"
    verb = "stay" if plural else "stays"
    what = f"(shape {shape_text(top.shape)}, {top.dtype} on {top.device})"
    others = ""
    if len(growing) > 1:
        held = top.grad_fn and any(not group.grad_fn for group in growing[1:4])
        others = (" Also growing (tensors these graphs saved for backward stay alive with them):" if held else
                  " Also growing:") + " " + "; ".join(
            f"~{group.per_step:.2g}/step {shape_text(group.shape)} {group.dtype}"
            + (f" {group.grad_fn}" if group.grad_fn else "") for group in growing[1:4]) + "."
    if top.grad_fn:
        graph = f", each keeping an autograd graph of {top.graph_nodes} nodes alive" if top.graph_nodes > 1 else ""
        if not top.shape:
            cause = ("scalars with a graph are losses or metrics, so a list keeps losses with their graphs (e.g. "
                     "self.history.append(loss)); store loss.detach() or loss.item() instead")
        else:
            cause = ("something (a list, a dict, a cache, a running total) keeps tensors that still carry their "
                     "autograd graph; store t.detach() (or t.item() / t.detach().cpu()) instead")
        return f"{rate} with grad_fn {top.grad_fn} {what} {verb} alive{graph}: {cause}.{others}{running}"
    return (f"{rate} {what} without a graph {verb} alive: something keeps a tensor per step (a list of outputs, "
            f"metrics or batches, a cache); keep a bounded window or Python numbers (t.item()), or detach() and "
            f"move them to the CPU if they must be kept.{others}{running}")
