"""What every rank failed at, in rank zero's report: one gather at the end of a run, with a bounded wait.

A check that fails on one rank is recorded there (:class:`~lightning_debug.core.guard.Failures`),
and the decisions of every rank stay the same (the failure is a flag in the step's collectives), but
only rank zero writes the report. So at the end of a run that finished on every rank, the ranks
gather their failed checks once and rank zero lists them all, each with the ranks it failed on.

The gather is preceded by a bounded wait (gloo's ``monitored_barrier``): a rank that does not come
is named in a failed check of its own after :data:`WAIT_S` seconds, instead of every rank waiting for
the process group's timeout (30 minutes). Other backends have no such barrier; the gather then runs
without it (it happens only when this rank finished, and Lightning ends every rank of a failed one).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

WAIT_S = 60.0


class RankNotResponding(RuntimeError):
    """A rank did not reach the plugin's gather within the bounded wait."""


def bounded_wait(seconds: float = WAIT_S) -> None:
    """Wait at most ``seconds`` for every rank (gloo's ``monitored_barrier``, which names the ranks that did
    not come); a no-op on one process and on backends without it. Raises :class:`RankNotResponding`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    if dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as error:
        raise RankNotResponding(f"not every rank reached the end-of-run gather within {seconds:.0f} s ({error})") \
            from error


def merge_failures(own: dict[str, dict[str, Any]], gathered: list[Any], rank: int) -> dict[str, dict[str, Any]]:
    """``own`` failed checks (of rank ``rank``) with those every rank gathered: counts added, steps widened,
    each reason prefixed with its rank, and ``ranks`` listing where the check failed.

    Example::

        >>> one = {"count": 1, "first_step": 3, "last_step": 3, "reasons": {"RuntimeError: boom": 1}}
        >>> merged = merge_failures({}, [{}, {"PerformanceMonitor.batch_end": one}], 0)
        >>> merged["PerformanceMonitor.batch_end"]["ranks"], merged["PerformanceMonitor.batch_end"]["reasons"]
        ([1], {'on rank 1: RuntimeError: boom': 1})
    """
    merged: dict[str, dict[str, Any]] = {}
    per_rank = [dict(entry) if isinstance(entry, dict) else {} for entry in gathered]
    if rank < len(per_rank):
        per_rank[rank] = own
    else:
        per_rank.append(own)
    for source, failed in enumerate(per_rank):
        for name, entry in failed.items():
            if not isinstance(entry, dict):
                continue
            reasons = {f"on rank {source}: {reason}": count for reason, count in (entry.get("reasons") or {}).items()}
            into = merged.get(name)
            if into is None:
                merged[name] = dict(entry, reasons=reasons, ranks=[source])
                continue
            into["count"] = into.get("count", 0) + entry.get("count", 0)
            into["first_step"] = min(into.get("first_step", 0), entry.get("first_step", 0))
            into["last_step"] = max(into.get("last_step", 0), entry.get("last_step", 0))
            into["reasons"] = dict(into["reasons"], **reasons)
            into["ranks"] = into["ranks"] + [source]
    return merged


def gather_failures(own: dict[str, dict[str, Any]],
                    gather: Callable[[Callable[[], Any]], list[Any]] | None = None) -> list[Any] | None:
    """Every rank's failed checks (one gather, after :func:`bounded_wait`: ``gather``, the run's gate, or
    ``all_gather_object``); call on every rank. None without a process group of several ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    bounded_wait()
    if gather is not None:
        return gather(lambda: own)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return gathered
