"""``replicas_diverged``: under data parallelism, ranks whose copies of a replicated parameter differ.

DDP keeps its replicas bit-identical, so each rank's norm of a parameter it holds whole is the same on every check
step (exchanged in the shared gradient pass's one all-reduce); a rank that differs trained on something else.
Only true replicas are compared (:func:`~lightning_debug.checks.numerics.replica_slots`); :data:`RELATIVE_TOLERANCE`
is for norm kernels that sum in another order on another rank (~1.5e-6 for 16M float32 elements), while one step
taken apart moves a norm by 1e-4 and more. Named: the ranks outside the largest group that agrees (on a tie, rank
0's). docs/distributed.md gives the causes::

    >>> squares = torch.tensor([[4.0, 1.0], [4.0, 1.21]], dtype=torch.float64)  # norms 2, 1 / 2, 1.1
    >>> verdict = judge_replicas(100, ["a", "b"], squares)
    >>> verdict.finding.kind.value, verdict.finding.details["parameters"], verdict.finding.details["ranks"]
    ('replicas_diverged', ['b'], [1])
    >>> judge_replicas(100, ["a", "b"], torch.tensor([[4.0, 1.0], [4.0, 1.0]], dtype=torch.float64)) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, WORST_SHOWN, Verdict, quoted

RELATIVE_TOLERANCE = 1e-5
"""How far two ranks' norms of one replica may be apart (relative to the larger): the reduction order, not a step."""


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agreeing_groups(values: Sequence[float], tolerance: float = RELATIVE_TOLERANCE) -> list[list[int]]:
    """The ranks grouped by the value they hold (within ``tolerance`` of the group's first), in rank order::

        >>> agreeing_groups([1.0, 2.0, 1.0])
        [[0, 2], [1]]
    """
    groups: list[list[int]] = []
    for rank, value in enumerate(values):
        group = next((g for g in groups if _close(value, values[g[0]], tolerance)), None)
        if group is None:
            groups.append([rank])
        else:
            group.append(rank)
    return groups


def judge_replicas(step: int, names: Sequence[str], squares: torch.Tensor,
                   tolerance: float = RELATIVE_TOLERANCE) -> Verdict | None:
    """The ``replicas_diverged`` verdict from ``squares`` (per rank, the squared norm of each of ``names``), or None.
    The healthy case is two vectorised comparisons on the host; names are read only when some differ."""
    if squares.dim() != 2 or squares.shape[0] < 2 or squares.shape[1] == 0:
        return None
    norms = squares.sqrt()
    reference = norms[0]
    scale = torch.maximum(norms, reference)
    apart = ((norms - reference).abs() > tolerance * scale).any(0) & torch.isfinite(norms).all(0)
    slots = apart.nonzero().flatten().tolist()
    if not slots:
        return None
    columns = norms[:, slots].T.tolist()
    diverged: list[str] = []
    ranks: set[int] = set()
    references: set[int] = set()
    differences: dict[str, float] = {}
    per_rank: dict[str, list[float]] = {}
    for slot, column in zip(slots, columns):
        groups = agreeing_groups(column, tolerance)
        agreed = max(groups, key=len)  # the first of the largest: rank 0's group on a tie
        name = names[slot]
        diverged.append(name)
        references.update(agreed)
        ranks.update(rank for group in groups if group is not agreed for rank in group)
        base = column[agreed[0]]
        differences[name] = max(abs(value - base) / max(abs(value), abs(base)) for value in column)
        if len(per_rank) < WORST_SHOWN:
            per_rank[name] = column
    off = sorted(ranks)
    agreeing = sorted(references - ranks) or sorted(references)
    first = diverged[0]
    shown = ", ".join(f"{per_rank[first][rank]:.6g} on rank {rank}" for rank in [agreeing[0], *off][:4])
    finding = Finding(
        Kind.REPLICAS_DIVERGED, Severity.ERROR,
        f"The data-parallel replicas differ at step {step}: {_ranks(off)} hold{'s' if len(off) == 1 else ''} other "
        f"values than {_ranks(agreeing)} for {len(diverged)} of {len(names)} replicated parameter(s), "
        f"{quoted(diverged)} (`{first}`: norm {shown}; relative difference {differences[first]:.2g}). Under DDP "
        "every rank holds the same weights; these ranks now train different models. Something changed the gradients "
        "or the weights on some ranks only: clipping or a gradient edit after DDP's all-reduce, a forward through "
        "the unwrapped module, weights re-initialised, reloaded or moved on one rank.",
        {"parameters": diverged[:NAMES_IN_DETAILS], "count": len(diverged), "judged": len(names), "ranks": off,
         "agreeing_ranks": agreeing, "norms": per_rank,
         "relative_difference": {name: differences[name] for name in diverged[:NAMES_IN_DETAILS]},
         "tolerance": tolerance})
    return Verdict(finding, diverged, key="replicas")
