"""The leak rule: steady growth of a byte count with the steps, suspected, confirmed, explained.

Readings go into a bounded window per series and a robust trend (:func:`~lightning_debug.checks.memory.fit_trend`)
says whether it grows steadily; docs/memory.md gives the healthy cases ruled out::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> series, verdicts = GrowthSeries(window=32, warmup_readings=0, min_spacing=1), VerdictEngine()
    >>> decided = []
    >>> for step in range(8):
    ...     _ = series.add(step, {"cpu_heap": 1e6 + 4e6 * step})
    ...     decided.append(judge_growth(step, series.growing(), verdicts))
    >>> [(step, d.by.value) for step, d in enumerate(decided) if d], growth_status(verdicts, judged=True).value
    ([(6, 'persisted'), (7, 'again')], 'growing')
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_debug.checks.memory import (
    MB,
    SERIES_LABELS,
    GraphGrowth,
    GroupGrowth,
    MemoryReading,
    Trend,
    explain_growth,
    fit_trend,
    format_bytes,
    is_steady_growth,
    steps_until_exhausted,
)
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.strenum import StrEnum
from lightning_debug.core.verdicts import Confirmed, Suspicion, VerdictEngine

# Below these rises over the trend window, growth is allocator granularity or warm-up creep.
GROWTH_FLOORS = {"cuda_allocated": 1.0 * MB, "cpu_heap": 1.0 * MB, "cpu_rss": 32.0 * MB, "workers_rss": 32.0 * MB}
# The latest half of the window must rise at least this share as fast as the whole: growth that goes on.
RECENT_SLOPE_SHARE = 0.5
INPUT_GROWTH = 1.5
# Readings of the next epoch that tell whether a growth kept past its epoch's end goes on (a leak) or stopped.
CARRIED_READINGS = 4
# The share of the last epoch's pace a growth keeps across an epoch's end when it goes on (see GrowthSeries.goes_on).
EPOCH_PACE = 0.9
# The series that grow with the input per step on a CPU (a CUDA allocator's bytes between steps do not).
INPUT_DRIVEN = frozenset({"cpu_heap", "cpu_rss", "workers_rss"})
KEY = "growth"
WORKERS_GROW = (
    "The training process's memory does not grow with it: the {} DataLoader worker processes do, and the tensor "
    "census cannot see into them. The Dataset, its transforms or collate_fn keep something from the items they "
    "serve, once in each worker, and persistent workers keep it for the whole run: a list or cache that only grows "
    "(a leak), or a per-item cache each worker fills with the items it is given (it grows towards one copy of the "
    "data set per worker). Bound it (functools.lru_cache(maxsize=...)), fill it before the workers start, or drop "
    "it; tracemalloc inside a worker (worker_init_fn) shows the line.")


class GrowthStatus(StrEnum):
    """The leak verdict in the report (``growth.status``), read from the verdict engine (:func:`growth_status`)."""

    NOT_ENOUGH = "not enough readings"
    NONE = "no steady growth"
    SUSPECTED = "suspected"
    GROWING = "growing"


class GrowthSeries:
    """Bounded windows of (step, bytes) per series and their trends::

        >>> series = GrowthSeries(window=4, warmup_readings=1, min_spacing=10)
        >>> [series.add(step, {"cpu_rss": 1.0}) for step in (0, 10, 15, 20)]
        [False, True, False, True]
        >>> list(series.points["cpu_rss"])
        [(10, 1.0), (20, 1.0)]
    """

    def __init__(self, window: int, warmup_readings: int, min_spacing: int) -> None:
        self.window = window
        self.warmup_readings = warmup_readings
        self.min_spacing = min_spacing
        self.points: dict[str, deque[tuple[int, float]]] = {}
        self.trends: dict[str, Trend] = {}
        self.readings = 0
        self.inputs: deque[tuple[int, int]] = deque(maxlen=window)
        self.epochs: deque[int | None] = deque(maxlen=window)

    def takes(self, step: int, last: bool = False) -> bool:
        """Whether :meth:`add` would take a reading at ``step`` (a reader may skip what it costs otherwise)."""
        latest = self.points["cpu_rss"][-1][0] if self.points.get("cpu_rss") else None
        spacing = 1 if last else self.min_spacing
        return self.readings + 1 > self.warmup_readings and (latest is None or step - latest >= spacing)

    def add(self, step: int, values: Mapping[str, float], elements: int | None = None,
            epoch: int | None = None, last: bool = False) -> bool:
        """Add a reading; False (nothing added) during warm-up or under ``min_spacing`` steps after the last one
        (``last``: the run's end, taken at any step after it)."""
        takes = self.takes(step, last)
        self.readings += 1
        if not takes:
            return False
        if elements:
            self.inputs.append((step, elements))
        self.epochs.append(epoch)
        for name, value in values.items():
            self.points.setdefault(name, deque(maxlen=self.window)).append((step, value))
        self.trends = {name: trend for name, points in self.points.items() if (trend := fit_trend(list(points)))}
        return True

    def growing(self) -> dict[str, Trend]:
        """The series that grow steadily and still rise, in the order of the reading (the resident set last)."""
        skipped = INPUT_DRIVEN if self.input_grew() else frozenset()
        return {name: trend for name, trend in self.trends.items()
                if name not in skipped and is_steady_growth(trend, GROWTH_FLOORS[name])
                and self._still_rising(name, trend)}

    def input_grew(self) -> bool:
        """Whether the window's later half was given ``INPUT_GROWTH`` times the input elements of its earlier half::

            >>> series = GrowthSeries(window=8, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_rss": 1.0}, 1024 if step < 4 else 4096) for step in range(8)]
            >>> series.input_grew()
            True
        """
        start = self.points["cpu_rss"][0][0] if self.points.get("cpu_rss") else 0
        sizes = [elements for step, elements in self.inputs if step >= start]
        if len(sizes) < 4:
            return False
        half = len(sizes) // 2
        return statistics.median(sizes[half:]) >= INPUT_GROWTH * statistics.median(sizes[:half])

    def one_epoch(self) -> int | None:
        """The epoch of every reading in the window, when they are all from one (else None)::

            >>> series = GrowthSeries(window=3, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_rss": 1.0}, epoch=step // 4) for step in range(6)]
            >>> series.one_epoch(), series.add(6, {"cpu_rss": 1.0}, epoch=1), series.one_epoch()
            (None, True, 1)
        """
        epochs = set(self.epochs)
        return epochs.pop() if len(epochs) == 1 else None

    def fell_back(self, names: Iterable[str], now: Mapping[str, float] | None = None) -> bool:
        """Whether one of ``names`` fell back at least halfway from the window's peak to its start (memory released);
        ``now``: a reading taken after the window's, its last value (a series it lacks, workers that ended, fell back)::

            >>> series = GrowthSeries(window=8, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_heap": value}) for step, value in enumerate((1.0, 5.0, 9.0, 2.0))]
            >>> series.fell_back(["cpu_heap"]), series.fell_back(["cpu_heap"], {"cpu_heap": 9.5}), series.fell_back(
            ...     ["cpu_heap"], {})
            (True, False, True)
        """
        for name in names:
            values = [value for _, value in self.points.get(name, ())]
            if now is not None and values:
                if name not in now:
                    return True
                values.append(now[name])
            if len(values) >= 2 and max(values) > values[0] and values[-1] <= (values[0] + max(values)) / 2:
                return True
        return False

    def goes_on(self, names: Iterable[str], since: int) -> bool | None:
        """Whether one of ``names`` rises from step ``since`` (an epoch's first reading) on at least ``EPOCH_PACE``
        as fast as before it: a leak keeps its pace across an epoch's end, a cache filled once stops, and a cache
        each of W persistent workers fills (each sees 1/W of the data an epoch) slows to (W - 1)/W. None while fewer
        than ``CARRIED_READINGS`` readings are that recent::

            >>> series = GrowthSeries(window=16, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_heap": 1e6 * min(step, 8)}) for step in range(11)]
            >>> series.goes_on(["cpu_heap"], since=8), series.add(11, {"cpu_heap": 8e6})
            (None, True)
            >>> series.goes_on(["cpu_heap"], since=8)
            False
        """
        for name in names:
            points = list(self.points.get(name, ()))
            recent = [(step, value) for step, value in points if step >= since]
            if len(recent) < CARRIED_READINGS:
                return None
            before, after = fit_trend([point for point in points if point[0] < since]), fit_trend(recent)
            if before is not None and after is not None and before.slope > 0 \
                    and after.slope >= EPOCH_PACE * before.slope:
                return True
        return False

    def epoch_boundary(self) -> int | None:
        """Where a window of several epochs is cut to compare its paces (:meth:`goes_on`): the first reading of an
        epoch with ``CARRIED_READINGS`` readings before it, the latest that leaves as many after it, else the latest;
        None where no epoch starts that late::

            >>> series = GrowthSeries(window=16, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_rss": 1.0}, epoch=step // 5) for step in range(7)]
            >>> series.epoch_boundary(), [series.add(step, {"cpu_rss": 1.0}, epoch=step // 5) for step in range(7, 14)]
            (5, [True, True, True, True, True, True, True])
            >>> series.epoch_boundary(), series.readings_since(10)
            (10, 4)
        """
        epochs = list(self.epochs)
        steps = [step for step, _ in self.points.get("cpu_rss", ())]
        if None in epochs or len(steps) != len(epochs):
            return None
        starts = [at for at in range(CARRIED_READINGS, len(epochs)) if epochs[at] != epochs[at - 1]]
        if not starts:
            return None
        enough = [at for at in starts if len(epochs) - at >= CARRIED_READINGS]
        return steps[enough[-1] if enough else starts[-1]]

    def readings_since(self, step: int) -> int:
        return sum(1 for at, _ in self.points.get("cpu_rss", ()) if at >= step)

    def state_dict(self) -> dict[str, Any]:
        return {"points": {name: [list(point) for point in points] for name, points in self.points.items()},
                "readings": self.readings, "inputs": [list(entry) for entry in self.inputs],
                "epochs": list(self.epochs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The window of a checkpoint (its trends fitted again)::

            >>> series = GrowthSeries(window=8, warmup_readings=0, min_spacing=1)
            >>> _ = [series.add(step, {"cpu_heap": 1e6 * step}, 64, epoch=0) for step in range(4)]
            >>> restored = GrowthSeries(window=8, warmup_readings=0, min_spacing=1)
            >>> restored.load_state_dict(series.state_dict())
            >>> restored.trends == series.trends, restored.readings, list(restored.epochs)
            (True, 4, [0, 0, 0, 0])
        """
        self.restart()
        for name, points in state.get("points", {}).items():
            self.points[name] = deque(((int(step), float(value)) for step, value in points), maxlen=self.window)
        self.trends = {name: trend for name, points in self.points.items() if (trend := fit_trend(list(points)))}
        self.readings = int(state.get("readings", 0))
        self.inputs.extend((int(step), int(elements)) for step, elements in state.get("inputs", ()))
        self.epochs.extend(state.get("epochs", ()))

    def restart(self) -> None:
        """Empty the window (the warm-up is not repeated)."""
        self.points.clear()
        self.trends.clear()
        self.inputs.clear()
        self.epochs.clear()

    def _still_rising(self, name: str, trend: Trend) -> bool:
        """Whether the latest half of the window rises at least ``RECENT_SLOPE_SHARE`` as fast as ``trend``."""
        points = list(self.points[name])
        recent = fit_trend(points[-max(3, len(points) // 2):])
        return recent is None or recent.slope >= RECENT_SLOPE_SHARE * trend.slope


def judge_growth(step: int, growing: Mapping[str, Trend], verdicts: VerdictEngine) -> Confirmed | None:
    """One reading in the window: growth is a suspicion held under the kind's policy; returns what it confirms
    (``persisted`` first: explain it from a second census; ``again`` while it goes on), else None::

        >>> verdicts = VerdictEngine()
        >>> judge_growth(0, {"cpu_heap": None}, verdicts), growth_status(verdicts, judged=True).value
        (None, 'suspected')
        >>> judge_growth(1, {}, verdicts), growth_status(verdicts, judged=True).value
        (None, 'no steady growth')
    """
    named = growth_named(verdicts)
    suspicions = [Suspicion(Kind.MEMORY_GROWTH, KEY, step, finding=named)] if growing else []
    decided = verdicts.observe(Kind.MEMORY_GROWTH, step, suspicions)
    return decided[0] if decided else None


def growth_named(verdicts: VerdictEngine) -> Finding | None:
    """The ``memory_growth`` finding of a growth confirmed and still going on (None otherwise)."""
    held = verdicts.latest(Kind.MEMORY_GROWTH, KEY)
    return None if held is None else held.finding


def growth_status(verdicts: VerdictEngine, judged: bool) -> GrowthStatus:
    """Where the leak rule stands, for the report, once a reading was ``judged``."""
    if verdicts.latest(Kind.MEMORY_GROWTH, KEY) is not None:
        return GrowthStatus.SUSPECTED if verdicts.holding(Kind.MEMORY_GROWTH) else GrowthStatus.GROWING
    return GrowthStatus.NONE if judged else GrowthStatus.NOT_ENOUGH


def headroom(series: str, reading: MemoryReading) -> tuple[float, str]:
    """The bytes ``series`` can still grow by, and what runs out (the GPU, else the machine's available memory)."""
    if series == "cuda_allocated":
        return (reading.cuda_total or 0) - (reading.cuda_allocated or 0), "this GPU"
    return reading.cpu_available, "this machine's available memory"


def lasts_past(step: int, end_step: int, growing: Mapping[str, Trend], reading: MemoryReading) -> bool:
    """Whether memory lasts past ``end_step`` at the rate of the first growing series."""
    name, trend = next(iter(growing.items()))
    return steps_until_exhausted(trend.slope, headroom(name, reading)[0]) > end_step - step


def growth_verdict(status: GrowthStatus, trends: Mapping[str, Trend], message: str | None = None) -> dict[str, Any]:
    """The report's ``growth`` entry: the status, every series' trend and whether it is significant::

        >>> growth_verdict(GrowthStatus.NONE, {})
        {'status': 'no steady growth', 'trends': {}}
    """
    verdict: dict[str, Any] = {"status": status.value, "trends": {
        name: dict(trend.summary(), significant=is_steady_growth(trend, GROWTH_FLOORS[name]))
        for name, trend in trends.items()}}
    if message is not None:
        verdict["message"] = message
    return verdict


def growth_finding(step: int, growing: Mapping[str, Trend], trends: Mapping[str, Trend], reading: MemoryReading,
                   census_step: int, grown: Sequence[GroupGrowth], graphs: Sequence[GraphGrowth],
                   sites: Sequence[dict[str, Any]], snapshot: str | None, census_ms: float) -> Finding:
    """The ``memory_growth`` finding: the rate, when memory runs out, and the cause from the census diff since
    ``census_step`` and the CUDA allocation sites still holding memory::

        >>> from lightning_debug.checks.memory import fit_trend
        >>> trend = fit_trend([(step, 2.0**20 * step) for step in range(0, 80, 10)])
        >>> reading = MemoryReading(cpu_rss=1, cpu_available=2**30, cpu_total=2**31, cpu_heap=2**26)
        >>> finding = growth_finding(70, {"cpu_heap": trend}, {"cpu_heap": trend}, reading, 60, [], [], [], None, 1.0)
        >>> finding.message[:60]
        'Memory grows steadily: CPU heap in use +1.0 MB/step over ste'
        >>> finding.details["run_out_step"]
        1094
    """
    steps = step - census_step
    name = next(iter(growing))
    trend = growing[name]
    room, what = headroom(name, reading)
    remaining = steps_until_exhausted(trend.slope, room)
    run_out_step = step + int(remaining) if math.isfinite(remaining) else None
    where_text = ""
    if sites:
        where_text = " Allocation sites still holding memory: " + "; ".join(
            f"{site['site']} ({site['alive']} live, {site['alive_mb']:.1f} MB)" for site in sites[:3]) + "."
    rate = (f"Memory grows steadily: {SERIES_LABELS[name]} +{format_bytes(trend.slope)}/step over steps "
            f"{trend.first_step}-{trend.last_step} ({trend.readings} readings)")
    if run_out_step is not None:
        rate += f"; at this rate {what} ({format_bytes(room)} left) runs out around step {run_out_step:,}"
    cause = WORKERS_GROW.format(reading.workers) if name == "workers_rss" else explain_growth(grown, steps, graphs)
    message = f"{rate}. {cause}{where_text}"
    details = {
        "series": name, "mb_per_step": trend.slope / MB, "run_out_step": run_out_step,
        "headroom_mb": room / MB,
        "trends": {series: trends[series].summary() for series in growing},
        "tensors": [group.to_dict() for group in grown[:5]],
        "growing_graphs": [graph.to_dict() for graph in graphs[:3]],
        "census_steps": [census_step, step], "census_ms": round(census_ms, 1),
        "cuda_sites": list(sites), "snapshot": snapshot,
    }
    return Finding(Kind.MEMORY_GROWTH, Severity.WARNING, message, details)
