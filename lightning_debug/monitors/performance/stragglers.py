"""The straggler rule: one rank consistently slower than the others before the gradient all-reduce."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from statistics import median_high
from typing import Any

from lightning_debug.checks.robust import median
from lightning_debug.checks.timing import PHASES, StepTimes
from lightning_debug.core.findings import Finding
from lightning_debug.core.gate import Planned, Shape
from lightning_debug.core.kinds import Kind, Severity

# The first STRAGGLER_WARMUP gathered check steps are not judged: lazy initialisation differs between ranks.
STRAGGLER_WARMUP = 5
STRAGGLER_WINDOW = 8
STRAGGLER_MIN_FLAGGED = 6
STRAGGLER_MARGIN = 0.5
STRAGGLER_STEP_SHARE = 0.2
STRAGGLER_MIN_MS = 5.0
GATHER_FIELDS = ("step", "step_ms", *(f"{phase.value}_ms" for phase in PHASES))


def gather_row(times: StepTimes | None) -> list[float]:
    """This rank's row of the all-gather: its latest timed step (NaN without one).

    Example::

        >>> gather_row(None)[:2], len(GATHER_FIELDS)
        ([nan, nan], 6)
    """
    if times is None:
        return [math.nan] * len(GATHER_FIELDS)
    return [float(times.step), times.judged_step_ms] + [times.judged(phase) for phase in PHASES]


_DATA, _FORWARD, _BACKWARD = (GATHER_FIELDS.index(name) for name in ("data_ms", "forward_ms", "backward_ms"))


def before_sync_ms(row: list[float]) -> float:
    """A rank's time before the gradient all-reduce: data wait + forward."""
    return row[_DATA] + row[_FORWARD]


def waited_for(rows: list[list[float]], rank: int) -> float:
    """How long the others waited for ``rank`` in the gradient all-reduce (ms): the smaller of its lead before it
    and how much longer the others' backward is than its own.

    Example::

        >>> late = [[0, 100.0, 5.0, 20.0, 70.0, 5.0], [0, 100.0, 5.0, 50.0, 40.0, 5.0]]
        >>> waited_before = [[0, 100.0, 5.0, 20.0, 70.0, 5.0], [0, 100.0, 35.0, 20.0, 68.0, 5.0]]
        >>> waited_for(late, 1), waited_for(waited_before, 1)
        (30.0, 2.0)
    """
    lead = before_sync_ms(rows[rank]) - median_high(before_sync_ms(row) for k, row in enumerate(rows) if k != rank)
    others = median(row[_BACKWARD] for k, row in enumerate(rows) if k != rank)
    return min(lead, others - rows[rank][_BACKWARD])


@dataclass(frozen=True)
class Straggler:
    """The rank slowest before the all-reduce on most of the window's check steps."""

    rank: int
    flagged_check_steps: int
    mean_ms_by_rank: dict[str, list[float]]
    median_before_sync_ms_by_rank: list[float]
    world_size: int
    median_wait_ms: float = 0.0

    @property
    def key(self) -> str:
        return f"rank{self.rank}"

    def finding(self) -> Finding:
        medians = self.median_before_sync_ms_by_rank
        others = median_high(ms for k, ms in enumerate(medians) if k != self.rank)
        return Finding(
            Kind.STRAGGLER_RANK, Severity.WARNING,
            f"Rank {self.rank} is the slowest on {self.flagged_check_steps} of the last {STRAGGLER_WINDOW} check "
            f"steps: its data wait + forward take {medians[self.rank]:.1f} ms (median) against "
            f"{others:.1f} ms on the other ranks, which wait {self.median_wait_ms:.1f} ms (median) "
            "for it in the gradient all-reduce (their backward phase is longer). Check that rank's data (uneven "
            "sample sizes or a slow shard), its GPU (clocks, temperature, other processes) and its CPU and "
            "data-loader workers.",
            {"rank": self.rank, "flagged_check_steps": self.flagged_check_steps,
             "window_check_steps": STRAGGLER_WINDOW, "mean_ms_by_rank": self.mean_ms_by_rank,
             "median_before_sync_ms_by_rank": medians, "median_wait_ms": self.median_wait_ms,
             "world_size": self.world_size})


@dataclass(frozen=True)
class Gathered:
    """One gathered check step that was judged."""

    step: int
    straggler: Straggler | None


class StragglerRule:
    """Which rank, if any, the others keep waiting for, from the per-rank rows gathered on check steps.

    Rank 0's extra work (logs, events, checkpoints) makes the others wait at the next collective, which lands in
    their data wait + forward, so a rank is judged by what the others wait for it *at the all-reduce*
    (:func:`waited_for`), on ``STRAGGLER_MIN_FLAGGED`` of ``STRAGGLER_WINDOW`` check steps.

    Example::

        >>> rule = StragglerRule()
        >>> def rows(step, slow):  # step, step_ms, data, forward, backward, optimizer for ranks 0 and 1
        ...     return [step, 100.0, 5.0, 20.0, 70.0, 5.0, step, 100.0, 5.0, 20.0 + slow, 45.0, 5.0]
        >>> [rule.judge(rows(step, 30.0)) for step in range(5)]
        [None, None, None, None, None]
        >>> results = [rule.judge(rows(step, 30.0)) for step in range(5, 13)]
        >>> results[0].straggler, results[-1].straggler.rank, results[-1].straggler.key
        (None, 1, 'rank1')
    """

    def __init__(self) -> None:
        self.gathered = 0
        self.window: deque[tuple[int | None, list[list[float]]]] = deque(maxlen=STRAGGLER_WINDOW)

    def judge(self, values: list[float]) -> Gathered | None:
        """Judge one all-gather's rows; None when a rank had no timed step, the ranks timed different steps, or in
        the warm-up."""
        width = len(GATHER_FIELDS)
        rows = [values[i:i + width] for i in range(0, len(values) - width + 1, width)]
        if len(rows) < 2 or any(not all(math.isfinite(v) for v in row) for row in rows):
            return None
        if len({row[0] for row in rows}) != 1:
            return None
        step = int(rows[0][0])
        self.gathered += 1
        if self.gathered <= STRAGGLER_WARMUP:
            return None
        before_sync = [before_sync_ms(row) for row in rows]
        slowest = max(range(len(rows)), key=lambda rank: before_sync[rank])
        typical = median_high(v for rank, v in enumerate(before_sync) if rank != slowest)
        step_ms = median(row[1] for row in rows)
        waited = waited_for(rows, slowest)
        slow = before_sync[slowest] > (1 + STRAGGLER_MARGIN) * typical and waited >= max(
            STRAGGLER_MIN_MS, STRAGGLER_STEP_SHARE * step_ms)
        self.window.append((slowest if slow else None, rows))
        flagged = Counter(rank for rank, _ in self.window if rank is not None)
        if len(self.window) < STRAGGLER_WINDOW or not flagged:
            return Gathered(step, None)
        rank, count = flagged.most_common(1)[0]
        if count < STRAGGLER_MIN_FLAGGED:
            return Gathered(step, None)
        window = [r for _, r in self.window]
        means = {field: [sum(r[k][i] for r in window) / len(window) for k in range(len(rows))]
                 for i, field in enumerate(GATHER_FIELDS) if field != "step"}
        medians = [median(before_sync_ms(r[k]) for r in window) for k in range(len(rows))]
        wait = median(waited_for(r, rank) for r in window)
        return Gathered(step, Straggler(rank, count, means, medians, len(rows), wait))


def straggler_plan(monitor: Any, step: int, stepped: bool) -> list[Planned]:
    """The straggler gather of a batch's end, on a check step of the performance ``monitor`` that took an optimizer
    step, under several processes: decided from values every rank shares, so every rank makes it.

    Example::

        >>> class Alone:
        ...     world_size, all_gather = 1, None
        >>> straggler_plan(Alone(), 4, True)
        []
    """
    if not stepped or monitor.world_size < 2 or monitor.all_gather is None or not monitor.schedule.is_due(step):
        return []
    return [Planned("stragglers", Shape.ROWS, len(GATHER_FIELDS), monitor.stopwatch.device, monitor.all_gather)]
