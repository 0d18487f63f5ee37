"""``lightning-debug report DIR``: rebuild report.json, report.md and the plots of a run after the fact.

Findings and statistics come from ``events.jsonl`` and the TensorBoard scalars of the run's own time span; a
report.json already there contributes only what a live run knows (status, configuration, sections), in the
parts that have the types a report needs. Nothing usable is a :class:`RunDirectoryError` (one line).

Example::

    >>> import json, tempfile, pathlib
    >>> from lightning_debug.report.offline import rebuild
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (run / "events.jsonl").write_text(json.dumps({"step": 3, "kind": "nonfinite_loss",
    ...     "severity": "error", "message": "The loss is NaN/Inf at step 3.", "episode": "start"}) + "\\n"
    ...     + '{"step": "three", "kind": 7}\\n')
    >>> result = rebuild(run, plots=False)
    >>> result.report["findings"]["nonfinite_loss"]["first_step"], result.report["status"], result.bad_lines
    (3, 'unknown', 1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_debug.core.context import RunStatus
from lightning_debug.core.events import EVENTS_FILENAME
from lightning_debug.core.findings import order_findings
from lightning_debug.core.guard import describe
from lightning_debug.core.timeline import Timeline
from lightning_debug.report.document import REPORT_JSON, REPORT_MD, build_report, write_report
from lightning_debug.report.events_file import (MAX_MESSAGE, EventsFile, EventsScan, is_int, iter_events, last_run,
                                                 printable, read_events_file)  # read_events_file: re-exported
from lightning_debug.report.scalars_file import (MAX_REPORT_BYTES, RUN_ID, RUN_MARKERS, ScalarFindings, TimeSpan,
                                                 merge_scalar_findings, next_run_start, parse_moment, run_id_start,
                                                 scalar_values, tensorboard_files)  # tensorboard_files: re-exported

Progress = Callable[[str], None]

MAX_DEPTH = 32
MAX_TEXT = 4000
STATUSES = tuple(status.value for status in RunStatus)


class RunDirectoryError(ValueError):
    """A directory that does not hold what a lightning-debug run leaves behind; the message is one line."""


def read_timeline(events: EventsFile | Iterable[dict[str, Any]] | None, tensorboard: list[Path],
                  progress: Progress | None = None, progress_every_s: float = 1.0,
                  scalars: ScalarFindings | None = None,
                  span: Callable[[], TimeSpan] | None = None) -> tuple[Timeline, list[str]]:
    """A timeline from events and TensorBoard files, and notes on files it skipped. A ``{}`` in ``events`` starts
    it afresh; ``span``, asked once the events are read (they name the run), keeps the run's own points only."""
    timeline = Timeline()
    notes: list[str] = []
    for record in events.records if isinstance(events, EventsFile) else events or []:
        if record:
            timeline.observe_event(record)
        else:
            timeline = Timeline()
    within = span() if span is not None else None
    for path in tensorboard:
        if within is not None and not within.may_hold(path):
            continue
        started = last_said = time.monotonic()
        points = 0
        try:
            for tag, step, value in scalar_values(path, within):
                timeline.observe_metrics({tag: value}, step)
                if scalars is not None:
                    scalars.observe(tag, step, value)
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


# --- report.json -----------------------------------------------------------------------------------
def _shallow(value: Any, limit: int = MAX_DEPTH) -> bool:
    """``value`` is JSON nested at most ``limit`` deep with string keys."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                return False
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return True


def _valid_finding(entry: Any) -> bool:
    return (isinstance(entry, dict) and all(is_int(entry.get(k)) for k in ("episodes", "steps", "first_step", "last_step"))
            and isinstance(entry.get("severity"), str) and isinstance(entry.get("first_message"), str))


def _valid_stat(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) and not isinstance(entry.get(k), bool) for k in ("count", "mean", "min", "max"))


def _valid_failure(entry: Any) -> bool:
    return (isinstance(entry, dict) and is_int(entry.get("count")) and is_int(entry.get("first_step"))
            and isinstance(entry.get("reasons", {}), dict) and all(isinstance(k, str) for k in entry.get("reasons", {})))


def _valid_section(section: Any) -> bool:
    markdown = section.get("markdown", {}) if isinstance(section, dict) else None
    return (isinstance(markdown, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in markdown.items())
            and _shallow(section))


def _existing_report(directory: Path, notes: list[str]) -> dict[str, Any]:
    """The parts of a report.json already there that have the types a report needs."""
    path = directory / REPORT_JSON
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_REPORT_BYTES:
        notes.append(f"ignored {path.name}: larger than {MAX_REPORT_BYTES >> 20} MiB")
        return {}
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except RecursionError:
        notes.append(f"ignored {path.name}: JSON nested too deep")
        return {}
    except (ValueError, UnicodeDecodeError) as error:
        notes.append(f"ignored the unreadable {path.name} ({str(error)[:200]})")
        return {}
    if not isinstance(raw, dict):
        notes.append(f"ignored {path.name}: not a JSON object")
        return {}
    kept: dict[str, Any] = {}
    if raw.get("status") in STATUSES:
        kept["status"] = raw["status"]
    if is_int(raw.get("last_step")) and raw["last_step"] >= 0:
        kept["last_step"] = raw["last_step"]
    for key in ("error", "run", "started", "ended"):
        if isinstance(raw.get(key), str):
            kept[key] = raw[key][:MAX_TEXT]
    for key, valid in (("findings", _valid_finding), ("stats", _valid_stat), ("failed_checks", _valid_failure),
                       ("sections", _valid_section)):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            notes.append(f"ignored {path.name}'s '{key}': not an object")
            continue
        good = {str(name): entry for name, entry in value.items() if valid(entry)}
        if len(good) < len(value):
            notes.append(f"ignored {len(value) - len(good)} malformed entr(y/ies) of {path.name}'s '{key}'")
        if key == "findings":  # what a person reads is cut and escaped, as the events' messages are
            good = {name: dict(entry, first_message=printable(entry["first_message"][:MAX_MESSAGE]))
                    for name, entry in good.items()}
        kept[key] = good
    if isinstance(raw.get("config"), dict) and _shallow(raw["config"]):
        kept["config"] = raw["config"]
    elif "config" in raw:
        notes.append(f"ignored {path.name}'s 'config': not a plain object")
    return kept


def _merge_findings(from_events: dict[str, Any], existing: dict[str, Any]) -> dict[str, Any]:
    """A live tally is exact: kept for a kind unless the events go on past it."""
    merged = dict(from_events)
    for kind, entry in existing.items():
        newer = from_events.get(kind)
        if newer is None or entry.get("last_step", -1) >= newer.get("last_step", -1):
            merged[kind] = entry
    return order_findings(merged)


# --- the verb ----------------------------------------------------------------------------------------
def find_run_directories(root: Path) -> list[Path]:
    """The debug directories at or under ``root`` (holding events.jsonl or report.json)."""
    if not root.exists():
        raise RunDirectoryError(f"no such directory: {root}")
    if not root.is_dir():
        raise RunDirectoryError(f"not a directory: {root}")
    found = sorted({path.parent for marker in RUN_MARKERS for path in root.rglob(marker) if path.is_file()})
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
    bad_lines: int = 0


def rebuild(directory: Path, plots: bool = True, progress: Progress | None = None) -> RebuildResult:
    """Rebuild report.json, report.md (and debug_analysis.png) in ``directory`` from its files."""
    notes: list[str] = []
    events_path = directory / EVENTS_FILENAME
    scan = EventsScan()
    has_events = events_path.is_file()
    if not has_events:
        notes.append("no events.jsonl (a run that found nothing writes none)")
    searched = [directory, directory.parent]
    if RUN_ID.fullmatch(directory.name):  # <logger folder>/debug_outputs/<run id>: a folder that held a run already
        searched.append(directory.parent.parent)
    tensorboard = tensorboard_files(searched)
    existing = _existing_report(directory, notes)
    spans: list[TimeSpan] = []

    def own_span() -> TimeSpan:
        run_id = existing.get("run") or scan.run
        start = parse_moment(existing.get("started")) or run_id_start(run_id)
        end = parse_moment(existing.get("ended"))
        if end is None and start is not None:
            end = next_run_start(searched[1:], start, run_id)
        spans.append(TimeSpan(start, end))
        return spans[0]

    if progress is not None and tensorboard:
        progress(f"reading {len(tensorboard)} TensorBoard file(s) next to {directory}")
    scalars = ScalarFindings()
    records = last_run(iter_events(events_path, scan), scan) if has_events else None
    timeline, skipped = read_timeline(records, tensorboard, progress, scalars=scalars, span=own_span)
    notes += skipped
    others = [path for path in tensorboard if not spans[0].may_hold(path)]
    tensorboard = [path for path in tensorboard if path not in others]
    if spans[0] != TimeSpan():
        notes.append(f"TensorBoard points of this run's time span only ({spans[0].describe()})"
                     + (f"; {len(others)} file(s) of other runs left out" if others else ""))
    if scan.bad:
        notes.append(f"skipped {scan.bad} malformed line(s) of events.jsonl, e.g. {'; '.join(scan.bad_examples)}")
    if scan.earlier_runs or scan.other_run_events:
        notes.append(f"events.jsonl holds events of {scan.earlier_runs} earlier run(s); this report is of the last "
                     f"one ({scan.run or 'no run id'}) only")
    from_events = timeline.findings()
    tensorboard_findings = {kind: entry for kind, entry in scalars.findings().items()
                            if kind not in existing.get("findings", {})}
    completed = sorted(kind for kind in tensorboard_findings if kind in from_events)
    merged = merge_scalar_findings(from_events, tensorboard_findings)
    completed = [kind for kind in completed if merged[kind].get("source")]
    tensorboard_findings = {kind: entry for kind, entry in tensorboard_findings.items() if kind not in from_events}
    if not (scan.read or existing or timeline.last_step >= 0):
        reason = (f"{scan.bad} malformed line(s), e.g. {scan.bad_examples[0]}" if scan.bad_examples
                  else "no events")
        raise RunDirectoryError(f"nothing usable in {directory}: events.jsonl has {reason}, and there is no valid "
                                "report.json or TensorBoard data")
    if not tensorboard:
        notes.append("no TensorBoard event files next to it: the plots show the findings only")
    if tensorboard_findings:
        notes.append(f"from the TensorBoard scalars, not events.jsonl: {', '.join(tensorboard_findings)}")
    if completed:
        notes.append(f"completed from the TensorBoard scalars (they go on past events.jsonl): {', '.join(completed)}")
    last_step = max(existing.get("last_step", -1), timeline.last_step)
    report = build_report(status=existing.get("status", RunStatus.UNKNOWN), step=last_step, sections={},
                          config=existing.get("config") or {}, error=existing.get("error"),
                          run_id=existing.get("run") or scan.run)
    report.update({key: existing[key] for key in ("started", "ended") if key in existing})
    report["findings"] = _merge_findings(merged, existing.get("findings") or {})
    report["stats"] = dict(timeline.stats(), **(existing.get("stats") or {}))
    report["sections"] = existing.get("sections") or {}
    report["failed_checks"] = existing.get("failed_checks") or {}
    report["rebuilt"] = {
        "events": printable(str(events_path)) if has_events else None,
        "events_read": scan.read,
        "bad_lines": scan.bad,
        "truncated_last_line": scan.truncated_last_line,
        "tensorboard": [printable(str(path)) for path in tensorboard],
        "findings_from_tensorboard": sorted(tensorboard_findings),
        "findings_completed_from_tensorboard": completed,
        "notes": [printable(note) for note in notes],  # a path that is not UTF-8 is written as its escapes
    }
    write_report(directory, report)
    result = RebuildResult(directory, report, [directory / REPORT_JSON, directory / REPORT_MD], notes, scan.read,
                           scan.truncated_last_line, tensorboard, scan.bad)
    if plots:
        from lightning_debug.report.plots import PlotsUnavailable, write_debug_analysis

        try:
            result.written.append(write_debug_analysis(directory, timeline, report))
        except PlotsUnavailable as missing:
            notes.append(str(missing))
        except Exception as error:  # the report files are written: a plot that fails is a note, not a failure
            notes.append(f"debug_analysis.png was not drawn ({type(error).__name__}: {describe(error)[:300]})")
    return result
