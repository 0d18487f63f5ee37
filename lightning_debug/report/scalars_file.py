"""The debug scalars of the TensorBoard files next to a run, for ``lightning-debug report``: a run killed after
its last event has the rest of its NaN steps and rising counts only here. A version folder can hold several runs'
files, so only the points of the run's own time span are read (:class:`TimeSpan`).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_debug.core.monitor import Monitor
from lightning_debug.core.session import RUN_MARKERS
from lightning_debug.report.document import moment

TENSORBOARD_COUNTS = {  # cumulative count scalar -> the finding its rise means
    "debug/grad/exploding_count": ("exploding_grad", "warning", "gradients exploded"),
    "debug/grad/vanishing_count": ("vanishing_grad", "warning", "gradients vanished"),
    "debug/grad/missing_count": ("missing_grad", "warning", "parameters received no gradient"),
}
MAX_REPORT_BYTES = 64 << 20  # a report.json larger than this is not read
RUN_ID = re.compile(r"(\d{8}-\d{6})-[0-9a-f]{6}")  # core.session.new_run_id: its start, UTC, to the second


def parse_moment(text: Any) -> float | None:
    """Seconds since the epoch of an ISO time (report.json's ``started``/``ended``), or None."""
    if not isinstance(text, str) or len(text) > 64:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)).timestamp()


def run_id_start(run_id: Any) -> float | None:
    """The start of the run ``run_id`` names, to the second (or None).

    Example::

        >>> run_id_start("20260102-030405-3fa2c1"), run_id_start("mine")
        (1767323045.0, None)
    """
    match = RUN_ID.fullmatch(run_id) if isinstance(run_id, str) else None
    if match is None:
        return None
    moment = datetime.datetime.strptime(match.group(1), "%Y%m%d-%H%M%S")
    return moment.replace(tzinfo=datetime.timezone.utc).timestamp()


@dataclass(frozen=True)
class TimeSpan:
    """The wall-clock span of one run's TensorBoard points (seconds since the epoch; None: open).

    Example::

        >>> span = TimeSpan(100.0, 200.0)
        >>> span.holds(150.0), span.holds(250.0), TimeSpan(None, None).holds(250.0)
        (True, False, True)
    """

    start: float | None = None
    end: float | None = None

    def holds(self, wall_time: float) -> bool:
        return (self.start is None or wall_time >= self.start) and (self.end is None or wall_time <= self.end)

    def may_hold(self, path: Path) -> bool:
        """Whether the event file ``path`` was neither created after the span's end nor written last before its
        start."""
        created = re.match(r"events\.out\.tfevents\.(\d+)\.", path.name)
        if self.end is not None and created is not None and int(created.group(1)) > self.end:
            return False
        return self.start is None or path.stat().st_mtime >= self.start

    def describe(self) -> str:
        return " to ".join("open" if seconds is None else moment(seconds) for seconds in (self.start, self.end))


def next_run_start(directories: Iterable[Path], after: float, own: str | None = None) -> float | None:
    """The earliest start after ``after`` of another run (not ``own``) whose run-id-named directory lies under
    ``directories``: where a run with no recorded end stopped writing. Its report.json's ``started`` where there is
    one (to the millisecond: two short runs can begin in the same second), else its run id's."""
    starts = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for folder in {path.parent for marker in RUN_MARKERS for path in directory.rglob(marker)}:
            start = run_id_start(folder.name) if folder.name != own else None
            if start is not None:
                start = _recorded_start(folder / RUN_MARKERS[1]) or start
                if start > after:
                    starts.append(start)
    return min(starts, default=None)


def _recorded_start(report: Path) -> float | None:
    """report.json's ``started``, or None."""
    try:
        if not report.is_file() or report.stat().st_size > MAX_REPORT_BYTES:
            return None
        raw = json.loads(report.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return parse_moment(raw.get("started")) if isinstance(raw, dict) else None


def tensorboard_files(directories: Iterable[Path]) -> list[Path]:
    """The TensorBoard event files directly in each directory, oldest first."""
    found: list[Path] = []
    for directory in directories:
        if directory.is_dir():
            found += sorted((p for p in directory.glob("events.out.tfevents.*") if p.is_file()),
                            key=lambda p: (p.stat().st_mtime, p.name))
    return found


def scalar_values(path: Path, span: TimeSpan | None = None) -> Iterator[tuple[str, int, float]]:
    """The debug scalars of an event file (those written within ``span`` only, when given)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    for event in EventFileLoader(str(path)).Load():
        if not event.HasField("summary") or (span is not None and not span.holds(event.wall_time)):
            continue
        for value in event.summary.value:
            if not value.tag.startswith("debug/"):
                continue
            if value.HasField("simple_value"):
                yield value.tag, int(event.step), float(value.simple_value)
            elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                yield value.tag, int(event.step), float(tensor_util.make_ndarray(value.tensor).item())


class ScalarFindings:
    """What the debug scalars show for runs whose events are missing or cut off: the steps where
    ``debug/loss_finite`` was 0 and where a cumulative count rose, as episodes counted as a live run counts them.

    Example::

        >>> scalars = ScalarFindings()
        >>> for step in range(20):
        ...     scalars.observe("debug/loss_finite", step, 0.0 if step % 5 == 4 else 1.0)
        >>> {k: v for k, v in scalars.findings()["nonfinite_loss"].items()
        ...  if k in ("episodes", "steps", "first_step", "last_step")}
        {'episodes': 4, 'steps': 4, 'first_step': 4, 'last_step': 19}
    """

    def __init__(self) -> None:
        self.spans: dict[str, list[int]] = {}  # tag -> [first, last, points, episodes, open, missed]
        self._last: dict[str, float] = {}

    def observe(self, tag: str, step: int, value: float) -> None:
        if tag == "debug/loss_finite":
            if value < 0:  # no loss seen at that check
                return
            hit = value == 0.0
        elif tag in TENSORBOARD_COUNTS or tag == "debug/anomaly/count":
            hit = math.isfinite(value) and value > self._last.get(tag, 0.0)
            self._last[tag] = value
        else:
            return
        span = self.spans.get(tag)
        if span is None:
            if not hit:
                return
            span = self.spans[tag] = [step, step, 0, 0, 0, 0]
        if hit:
            span[0], span[1], span[2] = min(span[0], step), max(span[1], step), span[2] + 1
            if not span[4]:
                span[3] += 1
            span[4], span[5] = 1, 0
        elif span[4]:
            span[5] += 1
            if span[5] >= Monitor.episode_grace:  # counted as a live run counts them
                span[4] = 0

    def findings(self) -> dict[str, dict[str, Any]]:
        """Findings in report.json's form, each with ``source: tensorboard``."""
        out: dict[str, dict[str, Any]] = {}

        def add(kind: str, severity: str, tag: str, what: str) -> None:
            first, last, points, episodes = self.spans[tag][:4]
            out[kind] = {"episodes": episodes, "steps": points, "first_step": first, "last_step": last,
                         "severity": severity, "callback": "TensorBoard", "source": "tensorboard",
                         "first_message": f"TensorBoard's {tag} shows {what} at steps {first}-{last} "
                                          f"({points} logged point(s)); events.jsonl has no event for it."}

        if "debug/loss_finite" in self.spans:
            add("nonfinite_loss", "error", "debug/loss_finite", "a NaN/Inf loss (0)")
        elif "debug/anomaly/count" in self.spans:
            add("nonfinite_grad", "error", "debug/anomaly/count", "check steps with NaN/Inf gradients or weights")
        for tag, (kind, severity, what) in TENSORBOARD_COUNTS.items():
            if tag in self.spans:
                add(kind, severity, tag, what)
        return out


def merge_scalar_findings(from_events: dict[str, Any], from_scalars: dict[str, Any]) -> dict[str, Any]:
    """The findings of events.jsonl completed by the scalars' (a killed run's later episodes are only in TensorBoard).
    Both are lower bounds, so per kind the larger counts and the wider span win.

    Example::

        >>> events = {"nonfinite_loss": {"episodes": 25, "steps": 25, "first_step": 4, "last_step": 124}}
        >>> scalars = {"nonfinite_loss": {"episodes": 99, "steps": 99, "first_step": 4, "last_step": 494}}
        >>> merged = merge_scalar_findings(events, scalars)["nonfinite_loss"]
        >>> merged["episodes"], merged["last_step"], merged["source"]
        (99, 494, 'events.jsonl and tensorboard')
    """
    merged = {kind: dict(entry) for kind, entry in from_events.items()}
    for kind, entry in from_scalars.items():
        mine = merged.get(kind)
        if mine is None:
            merged[kind] = dict(entry)
            continue
        if entry["last_step"] <= mine["last_step"] and entry["episodes"] <= mine["episodes"]:
            continue
        mine["episodes"] = max(mine["episodes"], entry["episodes"])
        mine["steps"] = max(mine["steps"], entry["steps"])
        mine["first_step"] = min(mine["first_step"], entry["first_step"])
        mine["last_step"] = max(mine["last_step"], entry["last_step"])
        mine["source"] = "events.jsonl and tensorboard"
    return merged
