"""``same_batch_on_ranks``: under data parallelism every rank trains on the same batch.

Each rank of a data-parallel run should read its own share of the data: a loader that is not sharded (an Accelerate
loop whose DataLoader was not given to ``accelerator.prepare``, a Lightning run with ``use_distributed_sampler=False``
and a sampler of its own, a plain DDP loop without a ``DistributedSampler``) hands every rank the same batches when
the ranks shuffle with one seed, or do not shuffle. Nothing fails: the run does N times the work for one rank's data,
and the gradients, averaged over N copies of one batch, are one rank's. On a check step each rank adds a fingerprint
of its batch (:func:`batch_print`, no sync) to the row it already sends in the shared pass's one collective; the rule
reads every rank's fingerprint and loss there, in a run whose every parameter is a replica (DDP). Identical fingerprints and bit-identical losses on every rank are the
same batches: different batches practically never share both (a loss computed from features gathered across ranks,
as CLIP's is, can be the same on every rank; the batches are not). Held 2 check steps in a row::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> same = [{"batch_print": 7.0, "loss_value": 0.5}, {"batch_print": 7.0, "loss_value": 0.5}]
    >>> engine = VerdictEngine()
    >>> [judge_shared_batches(step, same, engine) is not None for step in (0, 100)]
    [False, True]
    >>> apart = [{"batch_print": 7.0, "loss_value": 0.5}, {"batch_print": 8.0, "loss_value": 0.5}]
    >>> judge_shared_batches(200, apart, VerdictEngine()) is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.rules import CheckRead, Moment, rule
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.verdict import Verdict
from lightning_debug.monitors.repeats import batch_fingerprint

KEY = "ranks"


def batch_print(batch: Any) -> torch.Tensor | None:
    """One float64 from :func:`~lightning_debug.monitors.repeats.batch_fingerprint` (its values weighted by their
    position, so that no reordering of them keeps it), on the batch's device; None for a batch too small to judge."""
    fingerprint = batch_fingerprint(batch)
    if fingerprint is None:
        return None
    weights = torch.arange(1, fingerprint.numel() + 1, dtype=fingerprint.dtype, device=fingerprint.device)
    return (fingerprint * weights).sum().to(torch.float64)


def judge_shared_batches(step: int, ranks: Sequence[Mapping[str, float]], verdicts: VerdictEngine) -> Verdict | None:
    """The ``same_batch_on_ranks`` verdict of check step ``step`` from every rank's flags (its ``batch_print`` and
    ``loss_value``), or None. Not judged on one process, nor when a rank has no fingerprint or no finite loss."""
    if len(ranks) < 2:
        return None
    prints = [rank.get("batch_print", math.nan) for rank in ranks]
    losses = [rank.get("loss_value", math.nan) for rank in ranks]
    judged = all(math.isfinite(value) for value in prints + losses)
    same = judged and len(set(prints)) == 1 and len(set(losses)) == 1
    confirmed = verdicts.observe(Kind.SAME_BATCH_ON_RANKS, step,
                                 [Suspicion(Kind.SAME_BATCH_ON_RANKS, KEY, step)] if same else [])
    if not confirmed:
        return None
    since = confirmed[0].first.step
    world = len(ranks)
    return Verdict(Finding(
        Kind.SAME_BATCH_ON_RANKS, Severity.WARNING,
        f"Every rank trains on the same batch: on each check step since step {since} the {world} ranks' batches have "
        f"one fingerprint and their losses are bit for bit the same ({losses[0]:.6g}). The run does {world} times the "
        "work for one rank's data, and each averaged gradient is one batch's. The training DataLoader is not sharded "
        "across the ranks: give it to accelerator.prepare() (Accelerate), keep Lightning's distributed sampler "
        "(use_distributed_sampler=True, the default) or shard a sampler of your own by rank (DistributedSampler), "
        "and shuffle with a seed per epoch, not one generator seeded alike on every rank.",
        {"since_step": since, "ranks": world, "loss": losses[0], "batch_print": prints[0]}), [], key=KEY)


@rule(Kind.SAME_BATCH_ON_RANKS, at=Moment.CHECK_READ)
def shared_batches_at_check_read(facts: CheckRead) -> Verdict | None:
    """The registered rule: :func:`judge_shared_batches` once a check step's per-rank rows are on the host, in a run
    whose every parameter is a replica (DDP). Shards (FSDP2, tensor parallelism) are not judged: ranks of one
    tensor-parallel group share their batch by design."""
    host = facts.numbers
    names = getattr(host, "param_names", None)
    if not names or len(host.replica_names) != len(names):
        return None
    return judge_shared_batches(facts.step, host.ranks, facts.verdicts)


__all__ = ["batch_print", "judge_shared_batches", "shared_batches_at_check_read"]
