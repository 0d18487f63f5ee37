"""TensorBoard: the ``debug/`` charts grouped in the Custom Scalars tab, and findings as text at their step.

When the trainer logs to TensorBoard, the run's session writes, at setup on the global-zero
process, a custom-scalars layout with four groups (anomalies, gradients, memory, performance),
so the charts are found together instead of scattered through the Scalars tab while the run
goes on; at the end of the run the layout is written again without the charts that received
no data (TensorBoard shows the latest). Every event written to events.jsonl also becomes a text
entry ``debug/events/<kind>`` at its step (Text tab), so a spike in a chart can be matched with
what was found there.

Example (a plain ``SummaryWriter``, e.g. Accelerate's TensorBoard tracker)::

    >>> import tempfile
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from lightning_debug.core.session import DebugSession
    >>> from lightning_debug.tensorboard import attach_to_writer
    >>> session = DebugSession(None, True, None, {})
    >>> writer = SummaryWriter(tempfile.mkdtemp())
    >>> attach_to_writer(writer, session)
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from lightning_debug.core.session import DebugSession

LAYOUT_CATEGORIES = ("lightning-debug: anomalies", "lightning-debug: gradients", "lightning-debug: memory",
                     "lightning-debug: performance")
EVENT_TAG_PREFIX = "debug/events/"
MAX_TEXT_ENTRIES = 500
_ATTACHED = "_lightning_debug_layout_written"


def debug_layout() -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout: category -> chart title -> ``["Multiline", [tag regexes]]``.

    Regexes (Python ``re.match``) rather than fixed tags, so per-parameter charts and scalars
    added later fall into their group.
    """
    return {
        "lightning-debug: anomalies": {
            "loss finite (1 = finite, 0 = NaN/Inf)": ["Multiline", [r"debug/loss_finite$"]],
            "check steps with NaN/Inf (cumulative)": ["Multiline", [r"debug/anomaly/.*"]],
        },
        "lightning-debug: gradients": {
            "global gradient norm": ["Multiline", [r"debug/grad/global_norm$"]],
            "check steps flagged exploding / vanishing / missing (cumulative)": [
                "Multiline", [r"debug/grad/(exploding|vanishing|missing)_count$"]],
            "per-parameter gradient norms": ["Multiline", [r"debug/grad/norm/.*"]],
            "weight norms": ["Multiline", [r"debug/weight/norm/.*"]],
            "update ratio ||dw|| / ||w||": ["Multiline", [r"debug/weight/update_ratio.*"]],
        },
        "lightning-debug: memory": {
            "process RSS and C heap (MB)": ["Multiline", [r"debug/memory/cpu_(rss|heap)_mb$"]],
            "CUDA memory (MB)": ["Multiline", [r"debug/memory/cuda.*"]],
            "memory per phase (MB)": ["Multiline", [r"debug/memory/phase/.*"]],
            "system memory available and other (MB)": ["Multiline", [r"debug/memory/(?!cpu_rss|cpu_heap|cuda|phase/).*"]],
        },
        "lightning-debug: performance": {
            "step time (ms)": ["Multiline", [r"debug/perf/step_ms$"]],
            "step phases (ms)": ["Multiline", [r"debug/perf/(data|forward|backward|optimizer)_ms$"]],
            "throughput": ["Multiline", [r"debug/perf/.*_per_sec$"]],
        },
    }


def event_markdown(record: dict[str, Any]) -> str:
    """One event as the Markdown of a TensorBoard text entry."""
    details = record.get("details") or {}
    where = f"step {record.get('step')}, epoch {record.get('epoch')}, batch {record.get('batch')}"
    phase = {"start": "started", "end": "ended"}.get(str(record.get("episode")), "")
    lines = [f"**{record.get('kind')}** ({record.get('severity')}{', ' + phase if phase else ''}) at {where}, "
             f"from {record.get('callback')}", "", str(record.get("message", ""))]
    for key in ("parameters", "modules", "ranks"):
        names = details.get(key)
        if names:
            lines += ["", f"{key}: " + ", ".join(f"`{name}`" for name in list(names)[:20])]
    return "\n".join(lines)


def pruned_layout(tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """:func:`debug_layout` without the charts (and groups) that no tag in ``tags`` matches."""
    import re

    names = list(tags)
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in debug_layout().items():
        kept = {title: chart for title, chart in charts.items()
                if any(re.match(pattern, name) for pattern in chart[1] for name in names)}
        if kept:
            layout[category] = kept
    return layout


class EventText:
    """Session event listener writing each event as a text entry at its step (bounded per run);
    at the end of the run it rewrites the layout with only the charts that have data."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.written = 0

    def conclude(self, session: DebugSession) -> None:
        layout = pruned_layout(session.timeline.tags)
        if layout:
            self.writer.add_custom_scalars(layout)

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


def attach_to_writer(writer: Any, session: DebugSession, log_dir: str | None = None) -> bool:
    """Write the layout to a ``SummaryWriter`` (once per writer) and send the session's events to it.

    Returns False when ``writer`` cannot write custom scalars (not a TensorBoard writer).
    """
    if not callable(getattr(writer, "add_custom_scalars", None)) or not callable(getattr(writer, "add_text", None)):
        return False
    if not getattr(writer, _ATTACHED, False):
        writer.add_custom_scalars(debug_layout())
        try:
            setattr(writer, _ATTACHED, True)
        except AttributeError:
            pass
    session.event_listeners.append(EventText(writer))
    if log_dir:
        session.links.setdefault("tensorboard", f"tensorboard --logdir {log_dir}")
    return True


def attach_to_loggers(loggers: Iterable[Any], session: DebugSession) -> int:
    """Attach every TensorBoard logger of a Lightning trainer (call on the global-zero process only).

    Never raises: a logger that cannot be used becomes one warning. Returns how many were attached.
    """
    from lightning.fabric.loggers import TensorBoardLogger

    attached = 0
    for logger in loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        try:
            attached += attach_to_writer(logger.experiment, session, getattr(logger, "log_dir", None))
        except Exception as failure:
            warnings.warn(f"lightning-debug could not set up the TensorBoard layout ({type(failure).__name__}: "
                          f"{failure}); the debug/ charts are still logged.", RuntimeWarning)
    return attached
