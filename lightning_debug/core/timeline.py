"""What happened over the steps of a run, bounded: the series the plots draw and the episodes of each finding
(fed by the session; rebuilt offline by ``lightning_debug.report.offline``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_debug.core.findings import order_findings
from lightning_debug.core.kinds import severity_rank

AREA_NAMES = {
    "debug/perf/step_ms": "step_time_ms", "debug/perf/data_ms": "data_time_ms",
    "debug/memory/cpu_rss_mb": "memory/cpu_rss_mb", "debug/memory/cpu_heap_mb": "memory/cpu_heap_mb",
    "debug/memory/workers_rss_mb": "memory/workers_rss_mb",
    "debug/memory/cuda_allocated_mb": "memory/cuda_allocated_mb",
    "debug/memory/cuda_reserved_mb": "memory/cuda_reserved_mb", "debug/memory/cuda_peak_mb": "memory/cuda_peak_mb",
    "debug/grad/global_norm": "gradient_norm",
}
"""report.json's ``stats`` name of each plotted series that has one."""
PLOTTED_TAGS = (*AREA_NAMES, "debug/anomaly/count", "debug/loss_finite")
PER_OPTIMIZER_NORM = "debug/grad/global_norm_optimizer_"
"""With several optimizers the global norm is one series per optimizer (``..._optimizer_<i>``), plotted too."""
MAX_OPTIMIZER_SERIES = 8
LOSS_SERIES = "loss"
"""The training loss: what the anomaly check read, else the first logged tag outside ``debug/`` holding ``loss``."""
MAX_POINTS = 2048
MAX_EVENTS = 4096
MAX_TAGS = 10_000
MAX_KINDS = 1000


class Series:
    """A bounded ``(step, value)`` history of one scalar: past ``max_points``, neighbouring pairs are merged
    (keeping the larger value, so a spike survives) and only every second new point is taken, and so on.

        >>> series = Series(max_points=4)
        >>> for step in range(8):
        ...     series.add(step, float(step % 3))
        >>> len(series.points) <= 4, series.points[0][0]
        (True, 0)
    """

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max(2, max_points)
        self.points: list[tuple[int, float]] = []
        self.stride = 1
        self._pending: tuple[int, float] | None = None
        self._seen = 0

    def add(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return
        if self.stride > 1:
            kept = self._pending
            self._pending = (step, value) if kept is None else (kept[0], max(kept[1], value))
            self._seen += 1
            if self._seen % self.stride:
                return
            step, value = self._pending
            self._pending = None
        self.points.append((step, value))
        if len(self.points) > self.max_points:
            pairs = zip(self.points[0::2], self.points[1::2])
            merged = [(first[0], max(first[1], second[1])) for first, second in pairs]
            if len(self.points) % 2:
                merged.append(self.points[-1])
            self.points = merged
            self.stride *= 2
            self._seen = 0

    def values(self) -> tuple[list[int], list[float]]:
        points = self.points + ([self._pending] if self._pending is not None else [])
        return [p[0] for p in points], [p[1] for p in points]


@dataclass
class Episode:
    """One finding from the step it started to the step it ended (``None`` while open)."""

    kind: str
    severity: str
    first_step: int
    last_step: int | None
    message: str
    callback: str = ""
    key: str = ""
    check_steps: int = 1
    consequence_of: str = ""


@dataclass
class Timeline:
    """Scalars over steps and the episodes of every finding of one run."""

    series: dict[str, Series] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list)
    last_step: int = -1
    tags: set[str] = field(default_factory=set)
    loss_source: str = ""
    summaries: dict[str, dict[str, int]] = field(default_factory=dict)
    _open: dict[tuple[str, int], list[Episode]] = field(default_factory=dict, repr=False)

    def observe_metrics(self, metrics: dict[str, float], step: int) -> None:
        """A metrics sink: the series of the plotted tags, and the names of all tags (for the layout)."""
        for tag, value in metrics.items():
            if len(self.tags) < MAX_TAGS:
                self.tags.add(tag)
            if tag in PLOTTED_TAGS or (tag.startswith(PER_OPTIMIZER_NORM) and (
                    tag in self.series or len(self.optimizer_norms()) < MAX_OPTIMIZER_SERIES)):
                self._series(tag).add(int(step), float(value))
            elif not tag.startswith("debug/") and "loss" in tag.lower() and self.loss_source in ("", tag):
                self.loss_source = tag
                self._series(LOSS_SERIES).add(int(step), float(value))
        self.last_step = max(self.last_step, int(step))

    def _series(self, tag: str) -> Series:
        series = self.series.get(tag)
        if series is None:
            series = self.series[tag] = Series()
        return series

    def optimizer_norms(self) -> list[str]:
        """The per-optimizer global norm series held, in the optimizers' order.

            >>> timeline = Timeline()
            >>> timeline.observe_metrics({"debug/grad/global_norm_optimizer_1": 2.0,
            ...                           "debug/grad/global_norm_optimizer_0": 1.0}, 3)
            >>> timeline.optimizer_norms()
            ['debug/grad/global_norm_optimizer_0', 'debug/grad/global_norm_optimizer_1']
        """
        return sorted((tag for tag in self.series if tag.startswith(PER_OPTIMIZER_NORM)),
                      key=lambda tag: (len(tag), tag))

    def observe_loss(self, step: int, value: float) -> None:
        """The training loss of ``step`` as the anomaly check read it: it replaces a loss taken from logged tags, and
        a NaN/Inf loss leaves a gap.

            >>> timeline = Timeline()
            >>> timeline.observe_metrics({"train_loss": 2.5, "debug/grad/global_norm": 1.0}, 0)
            >>> timeline.loss_source, timeline.values(LOSS_SERIES)
            ('train_loss', ([0], [2.5]))
            >>> for step, loss in ((0, 2.4), (1, float("nan")), (2, 2.2)): timeline.observe_loss(step, loss)
            >>> timeline.loss_source, timeline.values(LOSS_SERIES)
            ('training loss', ([0, 2], [2.4, 2.2]))
        """
        if self.loss_source != "training loss":
            self.loss_source = "training loss"
            self.series.pop(LOSS_SERIES, None)
        self._series(LOSS_SERIES).add(int(step), float(value))

    def observe_event(self, record: dict[str, Any]) -> None:
        """An event listener: a start (or one-off) event opens an episode, an end event closes it."""
        step = int(record.get("step", -1))
        self.last_step = max(self.last_step, step)
        details = record.get("details") or {}
        kind = str(record.get("kind", "unknown"))
        if record.get("episode") == "summary":  # a kind's totals past the episodes written one by one
            if kind in self.summaries or len(self.summaries) < MAX_KINDS:
                totals = {name: int(details.get(name, 0)) for name in ("episodes", "steps", "first_step", "last_step")}
                kept = self.summaries.setdefault(kind, totals)
                if totals["episodes"] >= kept["episodes"]:
                    self.summaries[kind] = totals
            return
        if record.get("episode") == "end":  # the open episode it ends, found by kind and first step
            waiting = self._open.get((kind, int(details.get("first_step", step))))
            if waiting:
                episode = waiting.pop()
                episode.last_step = int(details.get("last_step", step))
                episode.key = str(details.get("key", ""))
                episode.check_steps = int(details.get("steps", 1))
            return
        if len(self.episodes) >= MAX_EVENTS:
            return
        episode = Episode(kind=kind, severity=str(record.get("severity", "info")), first_step=step,
                          last_step=None if record.get("episode") == "start" else step,
                          message=str(record.get("message", "")), callback=str(record.get("callback", "")),
                          consequence_of=str(details.get("consequence_of") or ""))
        self.episodes.append(episode)
        if episode.last_step is None:
            self._open.setdefault((kind, step), []).append(episode)

    def values(self, tag: str) -> tuple[list[int], list[float]]:
        series = self.series.get(tag)
        return series.values() if series is not None else ([], [])

    def findings(self) -> dict[str, dict[str, Any]]:
        """Per kind, the same fields as report.json's ``findings`` (as far as events tell them)."""
        out: dict[str, dict[str, Any]] = {}
        for episode in self.episodes:
            last = episode.last_step if episode.last_step is not None else max(self.last_step, episode.first_step)
            entry = out.setdefault(episode.kind, {
                "episodes": 0, "steps": 0, "first_step": episode.first_step, "last_step": last,
                "severity": episode.severity, "first_message": episode.message, "callback": episode.callback})
            if episode.consequence_of and entry["episodes"] == 0:
                entry["consequence_of"] = episode.consequence_of
            entry["episodes"] += 1
            entry["steps"] += episode.check_steps
            entry["first_step"] = min(entry["first_step"], episode.first_step)
            entry["last_step"] = max(entry["last_step"], last)
            if severity_rank(episode.severity) < severity_rank(entry["severity"]):
                entry["severity"] = episode.severity
        for kind, totals in self.summaries.items():
            entry = out.get(kind)
            if entry is None:
                continue
            for name in ("episodes", "steps", "last_step"):
                entry[name] = max(entry[name], totals[name])
            entry["first_step"] = min(entry["first_step"], totals["first_step"])
        return order_findings(out)

    def stats(self) -> dict[str, dict[str, Any]]:
        """count / mean / min / max of the plotted series, under report.json's area names."""
        out: dict[str, dict[str, Any]] = {}
        for tag, series in self.series.items():
            _, values = series.values()
            if values and tag in AREA_NAMES:
                out[AREA_NAMES[tag]] = {"count": len(values), "mean": sum(values) / len(values),
                                        "min": min(values), "max": max(values), "last": values[-1]}
        return out
