"""TensorBoard: the ``debug/`` charts grouped in the Custom Scalars tab next to the loss, findings as text at their
step, and at the end the report (Text tab).

Every tab groups tags by the text before the first ``/``, and dashboards depend on the ``debug/...`` names, so the
grouping by area lives in a Custom Scalars layout, with the user's loss first.

Example (a plain ``SummaryWriter``, e.g. Accelerate's TensorBoard tracker)::

    >>> import tempfile
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from lightning_debug.core.guard import Failures
    >>> from lightning_debug.core.session import Session
    >>> from lightning_debug.report.tensorboard import attach_to_writer
    >>> session = Session(None, True, None, Failures())
    >>> writer = SummaryWriter(tempfile.mkdtemp())
    >>> attach_to_writer(writer, session)
    True
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_debug.core.monitor import HistogramWriter
from lightning_debug.core.session import Session
from lightning_debug.report.document import failed_checks_markdown

EVENT_TAG_PREFIX = "debug/events/"
FAILED_CHECKS_TAG = "debug/failed_checks"
REPORT_TAG = "debug/report"
USER_LOSS_PATTERN = r"(?!debug/)(?i:.*loss.*)"
MAX_TEXT_ENTRIES = 500
_ATTACHED = "_lightning_debug_layout_written"


def debug_layout() -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout: category -> chart title -> ``["Multiline", [tag regexes]]`` (regexes, so
    per-parameter scalars fall into their group)."""
    return {
        "lightning-debug: anomalies": {
            "your loss (every tag with 'loss' outside debug/)": ["Multiline", [USER_LOSS_PATTERN]],
            "loss finite (1 = finite, 0 = NaN/Inf)": ["Multiline", [r"debug/loss_finite$"]],
            "check steps with NaN/Inf (cumulative)": ["Multiline", [r"debug/anomaly/.*"]],
        },
        "lightning-debug: gradients": {
            "global gradient norm": ["Multiline", [r"debug/grad/global_norm(_optimizer_\d+)?$"]],
            "check steps flagged exploding / vanishing / missing (cumulative)": [
                "Multiline", [r"debug/grad/(exploding|vanishing|missing)_count$"]],
            "per-parameter gradient norms": ["Multiline", [r"debug/grad/norm/.*"]],
            "weight norms": ["Multiline", [r"debug/weight/norm/.*"]],
            "update ratio ||dw|| / ||w||": ["Multiline", [r"debug/weight/update_ratio.*"]],
        },
        "lightning-debug: activations": {
            "fraction of zeros (dead ReLUs near 1)": ["Multiline", [r"debug/activation/.*/zero_fraction$"]],
            "fraction saturated (sigmoid/tanh)": ["Multiline", [r"debug/activation/.*/saturated_fraction$"]],
            "max |x|": ["Multiline", [r"debug/activation/.*/max_abs$"]],
            "mean": ["Multiline", [r"debug/activation/.*/mean$"]],
            "std": ["Multiline", [r"debug/activation/.*/std$"]],
            "non-finite values": ["Multiline", [r"debug/activation/.*/nonfinite_count$"]],
        },
        "lightning-debug: memory": {
            "process RSS and C heap (MB)": ["Multiline", [r"debug/memory/(cpu|workers)_(rss|heap)_mb$"]],
            "CUDA memory (MB)": ["Multiline", [r"debug/memory/cuda.*"]],
            "memory per phase (MB)": ["Multiline", [r"debug/memory/phase/.*"]],
            "system memory available and other (MB)": [
                "Multiline", [r"debug/memory/(?!cpu_rss|cpu_heap|workers_rss|cuda|phase/).*"]],
        },
        "lightning-debug: performance": {
            "step time (ms)": ["Multiline", [r"debug/perf/step_ms$"]],
            "step phases (ms)": ["Multiline", [r"debug/perf/(data|forward|backward|optimizer)_ms$"]],
            "throughput": ["Multiline", [r"debug/perf/.*_per_sec$"]],
        },
    }


LAYOUT_CATEGORIES = tuple(debug_layout())


def event_markdown(record: dict[str, Any]) -> str:
    """One event as the Markdown of a TensorBoard text entry."""
    details = record.get("details") or {}
    where = f"step {record.get('step')}, epoch {record.get('epoch')}, batch {record.get('batch')}"
    phase = {"start": "started", "end": "ended"}.get(str(record.get("episode")), "")
    lines = [f"**{record.get('kind')}** ({record.get('severity')}{', ' + phase if phase else ''}) at {where}, "
             f"from {record.get('callback')}", "", str(record.get("message", ""))]
    for key in ("parameters", "modules", "ranks", "samples"):
        names = details.get(key)
        if names:
            lines += ["", f"{key}: " + ", ".join(f"`{name}`" for name in list(names)[:20])]
    return "\n".join(lines)


def pruned_layout(tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """:func:`debug_layout` without the debug charts that no tag of the run matches; the chart of the user's own
    loss, which the run does not see, is kept."""
    names = list(tags)
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in debug_layout().items():
        kept = {title: chart for title, chart in charts.items()
                if USER_LOSS_PATTERN in chart[1]
                or any(re.match(pattern, name) for pattern in chart[1] for name in names)}
        if kept:
            layout[category] = kept
    return layout


class EventText:
    """Session event listener writing each event as a text entry at its step (bounded); at the end it rewrites the
    layout with the charts that have data and adds the report. The plot stays a file: as an image it would be the
    first card of the Time Series tab, above the user's own loss."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.written = 0

    def conclude(self, session: Session, files: list[Path]) -> None:
        layout = pruned_layout(session.timeline.tags)
        if layout:
            self.writer.add_custom_scalars(layout)
        step = max(session.timeline.last_step, 0)
        for path in files:
            if path.suffix == ".md":
                self.writer.add_text(REPORT_TAG, path.read_text(encoding="utf-8"), global_step=step)
        failed = session.failures.summary()
        if failed:
            last = max(int(entry["last_step"]) for entry in failed.values())
            self.writer.add_text(FAILED_CHECKS_TAG, "\n".join(failed_checks_markdown(failed)), global_step=max(last, 0))

    def __call__(self, record: dict[str, Any]) -> None:
        if self.written > MAX_TEXT_ENTRIES:
            return
        self.written += 1
        step = int(record.get("step", 0))
        if self.written > MAX_TEXT_ENTRIES:
            self.writer.add_text(EVENT_TAG_PREFIX + "more", f"More than {MAX_TEXT_ENTRIES} events: the rest are "
                                 "only in events.jsonl.", global_step=step)
            return
        self.writer.add_text(EVENT_TAG_PREFIX + str(record.get("kind", "unknown")), event_markdown(record),
                             global_step=step)


def histogram_writer(candidates: Iterable[Any]) -> HistogramWriter | None:
    """A writer of raw histograms into the first of ``candidates`` that has ``add_histogram_raw``, or None."""
    for candidate in candidates:
        add = getattr(candidate, "add_histogram_raw", None)
        if callable(add):
            return lambda tag, histogram, step, _add=add: _add(tag, global_step=step, **histogram)
    return None


def attach_to_writer(writer: Any, session: Session, log_dir: str | None = None) -> bool:
    """Write the layout to a ``SummaryWriter`` (once per writer) and send the session's events to it; False when
    ``writer`` is not a TensorBoard writer."""
    if not callable(getattr(writer, "add_custom_scalars", None)) or not callable(getattr(writer, "add_text", None)):
        return False
    if not getattr(writer, _ATTACHED, False):
        writer.add_custom_scalars(debug_layout())
        with contextlib.suppress(AttributeError):
            setattr(writer, _ATTACHED, True)
    session.event_listeners.append(EventText(writer))
    if log_dir:
        session.links.setdefault("tensorboard", f"tensorboard --logdir {shlex.quote(str(log_dir))}")
    return True
