"""What happened over the steps of a run, bounded: the series the plots draw and the episodes of each finding.

During training the session feeds a :class:`Timeline` with every batch of ``debug/`` scalars it
hands to the logger and every event it writes; offline, :func:`read_timeline` rebuilds the same
thing from ``events.jsonl`` and the TensorBoard event files. Either way the plots and the
offline report are drawn from one object whose memory does not grow with the run's length.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_debug.core.findings import SEVERITY_ORDER

PLOTTED_TAGS = (
    "debug/perf/step_ms", "debug/perf/data_ms",
    "debug/memory/cpu_rss_mb", "debug/memory/cpu_heap_mb", "debug/memory/cuda_allocated_mb", "debug/memory/cuda_reserved_mb",
    "debug/memory/cuda_peak_mb",
    "debug/grad/global_norm", "debug/anomaly/count", "debug/loss_finite",
)
MAX_POINTS = 2048
MAX_EVENTS = 4096
MAX_TAGS = 10_000

Progress = Callable[[str], None]


class Series:
    """A bounded ``(step, value)`` history of one scalar.

    Every point is kept until ``max_points``; then neighbouring pairs are merged (keeping the
    larger value, so a spike survives) and only every second new point is taken, and so on. The
    curve keeps its shape over the whole run at a constant memory cost.

    Example::

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


@dataclass
class Timeline:
    """Scalars over steps and the episodes of every finding of one run."""

    series: dict[str, Series] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list)
    events_seen: int = 0
    events_dropped: int = 0
    last_step: int = -1
    tags: set[str] = field(default_factory=set)

    def observe_metrics(self, metrics: dict[str, float], step: int) -> None:
        """A metrics sink: the series of the plotted tags, and the names of all tags (for the layout)."""
        for tag, value in metrics.items():
            if len(self.tags) < MAX_TAGS:
                self.tags.add(tag)
            if tag in PLOTTED_TAGS:
                self.series.setdefault(tag, Series()).add(int(step), float(value))
        self.last_step = max(self.last_step, int(step))

    def observe_event(self, record: dict[str, Any]) -> None:
        """An event listener: a start (or one-off) event opens an episode, an end event closes it."""
        self.events_seen += 1
        step = int(record.get("step", -1))
        self.last_step = max(self.last_step, step)
        details = record.get("details") or {}
        kind = str(record.get("kind", "unknown"))
        if record.get("episode") == "end":
            first = int(details.get("first_step", step))
            last = int(details.get("last_step", step))
            for episode in reversed(self.episodes):
                if episode.kind == kind and episode.first_step == first and episode.last_step is None:
                    episode.last_step = last
                    episode.key = str(details.get("key", ""))
                    episode.check_steps = int(details.get("steps", 1))
                    return
            return
        if len(self.episodes) >= MAX_EVENTS:
            self.events_dropped += 1
            return
        self.episodes.append(Episode(
            kind=kind, severity=str(record.get("severity", "info")), first_step=step,
            last_step=None if record.get("episode") == "start" else step,
            message=str(record.get("message", "")), callback=str(record.get("callback", ""))))

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
            entry["episodes"] += 1
            entry["steps"] += episode.check_steps
            entry["first_step"] = min(entry["first_step"], episode.first_step)
            entry["last_step"] = max(entry["last_step"], last)
            if SEVERITY_ORDER.get(episode.severity, 9) < SEVERITY_ORDER.get(entry["severity"], 9):
                entry["severity"] = episode.severity
        return dict(sorted(out.items(), key=lambda item: (SEVERITY_ORDER.get(item[1]["severity"], 9),
                                                          item[1]["first_step"])))

    def stats(self) -> dict[str, dict[str, Any]]:
        """count / mean / min / max of the plotted series, under report.json's area names."""
        out: dict[str, dict[str, Any]] = {}
        for tag, series in self.series.items():
            _, values = series.values()
            if values and tag in AREA_NAMES:
                out[AREA_NAMES[tag]] = {"count": len(values), "mean": sum(values) / len(values),
                                        "min": min(values), "max": max(values), "last": values[-1]}
        return out


AREA_NAMES = {
    "debug/perf/step_ms": "step_time_ms", "debug/perf/data_ms": "data_time_ms",
    "debug/memory/cpu_rss_mb": "memory/cpu_rss_mb", "debug/memory/cpu_heap_mb": "memory/cpu_heap_mb",
    "debug/memory/cuda_allocated_mb": "memory/cuda_allocated_mb",
    "debug/memory/cuda_reserved_mb": "memory/cuda_reserved_mb", "debug/memory/cuda_peak_mb": "memory/cuda_peak_mb",
    "debug/grad/global_norm": "gradient_norm",
}


# --- offline -------------------------------------------------------------------------------------
class RunDirectoryError(ValueError):
    """A directory that does not hold what a lightning-debug run leaves behind; the message is one line."""


@dataclass
class EventsFile:
    records: list[dict[str, Any]]
    truncated_last_line: bool


def read_events_file(path: Path) -> EventsFile:
    """Parse events.jsonl strictly: a bad line is an error, except a truncated last line (a crash mid-write)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RunDirectoryError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    lines = text.split("\n")
    complete_end = text.endswith("\n")
    records: list[dict[str, Any]] = []
    truncated = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not complete_end:
                truncated = True
                continue
            raise RunDirectoryError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict) or "kind" not in record or not isinstance(record.get("step"), int):
            raise RunDirectoryError(f"{path}:{number}: not a lightning-debug event (needs an object with "
                                    "'kind' and an integer 'step')")
        records.append(record)
    return EventsFile(records, truncated)


def tensorboard_files(directories: Iterable[Path]) -> list[Path]:
    """The TensorBoard event files directly in each directory, oldest first."""
    found: list[Path] = []
    for directory in directories:
        if directory.is_dir():
            found += sorted(directory.glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name))
    return found


def _scalar_values(path: Path) -> Iterator[tuple[str, int, float]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    for event in EventFileLoader(str(path)).Load():
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            if not value.tag.startswith("debug/"):
                continue
            if value.HasField("simple_value"):
                yield value.tag, int(event.step), float(value.simple_value)
            elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                yield value.tag, int(event.step), float(tensor_util.make_ndarray(value.tensor).item())


def read_timeline(events: EventsFile | None, tensorboard: list[Path], progress: Progress | None = None,
                  progress_every_s: float = 1.0) -> tuple[Timeline, list[str]]:
    """A timeline from parsed events and TensorBoard files; returns it and notes on files it skipped."""
    timeline = Timeline()
    notes: list[str] = []
    for record in events.records if events is not None else []:
        timeline.observe_event(record)
    for path in tensorboard:
        started = last_said = time.monotonic()
        points = 0
        try:
            for tag, step, value in _scalar_values(path):
                timeline.observe_metrics({tag: value}, step)
                points += 1
                now = time.monotonic()
                if progress is not None and now - last_said >= progress_every_s:
                    last_said = now
                    progress(f"reading {path.name}: {points} debug scalars so far ({now - started:.0f} s)")
        except Exception as error:  # a damaged file loses its own points only
            notes.append(f"skipped the rest of {path} ({type(error).__name__}: {error})")
        if progress is not None:
            progress(f"read {points} debug scalars from {path.name}")
    return timeline, notes
