"""``lightning-debug report DIR``: rebuild report.json, report.md and the plots of a run after the fact.

For a run that died without writing its report (killed, out of memory on the host), or one whose
report you want again with a newer version: everything is rebuilt from ``events.jsonl`` and the
TensorBoard event files next to it (the debug directory itself and the log directory holding it).
A report.json already there contributes what only a live run knows (status, configuration,
per-callback sections); findings and statistics come from the files.

Example::

    >>> import json, tempfile, pathlib
    >>> from lightning_debug.offline import rebuild
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (run / "events.jsonl").write_text(json.dumps({"step": 3, "kind": "nonfinite_loss",
    ...     "severity": "error", "message": "The loss is NaN/Inf at step 3.", "episode": "start"}) + "\\n")
    >>> result = rebuild(run, plots=False)
    >>> result.report["findings"]["nonfinite_loss"]["first_step"], result.report["status"]
    (3, 'unknown')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_debug.core.events import EventLog
from lightning_debug.core.findings import SEVERITY_ORDER
from lightning_debug.core.report import build_report, write_report
from lightning_debug.core.timeline import (
    EventsFile,
    Progress,
    RunDirectoryError,
    read_events_file,
    read_timeline,
    tensorboard_files,
)

REPORT_FILENAME = "report.json"


def find_run_directories(root: Path) -> list[Path]:
    """The debug directories at or under ``root``: those holding events.jsonl or report.json."""
    if not root.exists():
        raise RunDirectoryError(f"no such directory: {root}")
    if not root.is_dir():
        raise RunDirectoryError(f"not a directory: {root}")
    markers = (EventLog.FILENAME, REPORT_FILENAME)
    if any((root / marker).is_file() for marker in markers):
        return [root]
    found = sorted({path.parent for marker in markers for path in root.rglob(marker) if path.is_file()})
    if not found:
        raise RunDirectoryError(f"no events.jsonl under {root}: give a run's debug_outputs directory or the log "
                                "directory that holds it")
    return found


@dataclass
class RebuildResult:
    directory: Path
    report: dict[str, Any]
    written: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    events: int = 0
    truncated_last_line: bool = False
    tensorboard: list[Path] = field(default_factory=list)


def _existing_report(directory: Path, notes: list[str]) -> dict[str, Any]:
    path = directory / REPORT_FILENAME
    if not path.is_file():
        return {}
    try:
        existing = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        notes.append(f"ignored the unreadable {path.name} ({error})")
        return {}
    if not isinstance(existing, dict):
        notes.append(f"ignored {path.name}: not a JSON object")
        return {}
    return existing


def _merge_findings(from_events: dict[str, Any], existing: dict[str, Any]) -> dict[str, Any]:
    """A live tally is exact; keep it for a kind unless the events go on past it."""
    merged = dict(from_events)
    for kind, entry in existing.items():
        if not isinstance(entry, dict):
            continue
        newer = from_events.get(kind)
        if newer is None or entry.get("last_step", -1) >= newer.get("last_step", -1):
            merged[kind] = entry
    return dict(sorted(merged.items(), key=lambda item: (SEVERITY_ORDER.get(item[1].get("severity"), 9),
                                                         item[1].get("first_step", 0))))


def rebuild(directory: Path, plots: bool = True, progress: Progress | None = None) -> RebuildResult:
    """Rebuild report.json, report.md (and debug_analysis.png) in ``directory`` from its files.

    Raises :class:`RunDirectoryError` (one-line message) for a malformed events.jsonl; a
    truncated last line (a crash in the middle of a write) is skipped and reported in the result.
    """
    notes: list[str] = []
    events_path = directory / EventLog.FILENAME
    events: EventsFile | None = read_events_file(events_path) if events_path.is_file() else None
    if events is None:
        notes.append("no events.jsonl (a run that found nothing writes none)")
    tensorboard = tensorboard_files([directory, directory.parent])
    if progress is not None and tensorboard:
        progress(f"reading {len(tensorboard)} TensorBoard file(s) next to {directory}")
    timeline, skipped = read_timeline(events, tensorboard, progress)
    notes += skipped
    if not tensorboard:
        notes.append("no TensorBoard event files next to it: the plots show the findings only")
    existing = _existing_report(directory, notes)
    recorded_step = existing.get("last_step")
    last_step = max(recorded_step if isinstance(recorded_step, int) else -1, timeline.last_step)
    report = build_report(status=str(existing.get("status", "unknown")), step=last_step, sections={},
                          config=existing.get("config") or {}, error=existing.get("error"))
    report["findings"] = _merge_findings(timeline.findings(), existing.get("findings") or {})
    report["stats"] = dict(timeline.stats(), **(existing.get("stats") or {}))
    report["sections"] = existing.get("sections") or {}
    report["rebuilt"] = {
        "events": str(events_path) if events is not None else None,
        "events_read": len(events.records) if events is not None else 0,
        "truncated_last_line": bool(events and events.truncated_last_line),
        "tensorboard": [str(path) for path in tensorboard],
        "notes": notes,
    }
    write_report(directory, report)
    result = RebuildResult(directory, report, [directory / REPORT_FILENAME, directory / "report.md"], notes,
                           len(events.records) if events is not None else 0,
                           bool(events and events.truncated_last_line), tensorboard)
    if plots:
        from lightning_debug.plots import PlotsUnavailable, write_debug_analysis

        try:
            result.written.append(write_debug_analysis(directory, timeline, report))
        except PlotsUnavailable as missing:
            notes.append(str(missing))
    return result
