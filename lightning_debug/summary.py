"""The end of a run for a person: ``debug_analysis.png`` and a compact summary on the console.

:meth:`DebugSession.conclude <lightning_debug.core.session.DebugSession.conclude>` calls
:func:`conclude_run` once per run on the global-zero process, after report.json is written. The
summary goes through rich when it is installed and is plain text otherwise; both say what was
found (most severe first), at which steps, and where the files are.

Example::

    >>> from lightning_debug.summary import summary_lines
    >>> report = {"status": "finished", "last_step": 80, "findings": {"nonfinite_loss": {
    ...     "severity": "error", "first_step": 40, "last_step": 79, "episodes": 1, "steps": 40,
    ...     "first_message": "The loss is NaN/Inf at step 40."}}}
    >>> print("\\n".join(summary_lines(report, {})))
    lightning-debug: run finished at step 80, 1 kind(s) of finding
      error     nonfinite_loss         steps 40-79  The loss is NaN/Inf at step 40.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

from lightning_debug.core.session import DebugSession

MESSAGE_WIDTH = 110
SEVERITY_STYLES = {"critical": "bold white on red", "error": "bold red", "warning": "yellow", "info": "dim"}


def _span(entry: dict[str, Any]) -> str:
    if entry["first_step"] == entry["last_step"]:
        return f"step {entry['first_step']}"
    return f"steps {entry['first_step']}-{entry['last_step']}"


def _short(message: str, width: int = MESSAGE_WIDTH) -> str:
    first_sentence = message.split(". ")[0].rstrip(".") + "."
    text = first_sentence if len(first_sentence) <= width else first_sentence[:width - 3] + "..."
    return text


def _headline(report: dict[str, Any]) -> str:
    findings = report.get("findings") or {}
    found = f"{len(findings)} kind(s) of finding" if findings else "nothing wrong found"
    status = report.get("status", "?")
    outcome = f"run {status}" if status in ("finished", "failed", "interrupted") else f"run status {status}"
    return f"lightning-debug: {outcome} at step {report.get('last_step', '?')}, {found}"


def summary_lines(report: dict[str, Any], files: dict[str, str]) -> list[str]:
    """The plain-text summary: a headline, one line per finding kind, one per file to open."""
    lines = [_headline(report)]
    for kind, entry in (report.get("findings") or {}).items():
        lines.append(f"  {entry['severity']:<9} {kind:<22} {_span(entry):<12} {_short(str(entry['first_message']))}")
    for label, where in files.items():
        lines.append(f"  {label + ':':<9} {where}")
    return lines


def print_summary(report: dict[str, Any], files: dict[str, str], stream: TextIO | None = None) -> None:
    """Print the summary with rich when it is installed, as plain text otherwise."""
    stream = stream if stream is not None else sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        stream.write("\n".join(summary_lines(report, files)) + "\n")
        return
    is_terminal = bool(getattr(stream, "isatty", lambda: False)())
    console = Console(file=stream, highlight=False, soft_wrap=False, width=None if is_terminal else 120)
    findings = report.get("findings") or {}
    table = Table(title=_headline(report), title_justify="left", show_header=bool(findings), box=None,
                  padding=(0, 1), expand=False)
    spans = [_span(entry) for entry in findings.values()]
    widths = [9, max([len(kind) for kind in findings] + [7]), max([len(span) for span in spans] + [5])]
    table.add_column("severity", no_wrap=True, width=widths[0])
    table.add_column("finding", no_wrap=True, width=widths[1])
    table.add_column("where", no_wrap=True, width=widths[2])
    table.add_column("what", no_wrap=True, overflow="ellipsis", width=max(20, console.width - sum(widths) - 9))
    for kind, entry in findings.items():
        severity = str(entry["severity"])
        table.add_row(f"[{SEVERITY_STYLES.get(severity, '')}]{severity}[/]", kind, _span(entry),
                      _short(str(entry["first_message"])))
    console.print(table)
    for label, where in files.items():
        console.print(f"  [bold]{label}:[/] {where}", overflow="fold")


def conclude_run(session: DebugSession, report: dict[str, Any]) -> None:
    """Draw the plots (``save_plots``) and print the summary (``print_summary``); never raises."""
    files: dict[str, str] = {}
    config = session.config
    for listener in session.event_listeners:
        conclude = getattr(listener, "conclude", None)
        if callable(conclude):
            try:
                conclude(session)
            except Exception as failure:
                warnings.warn(f"lightning-debug: finishing {type(listener).__name__} failed "
                              f"({type(failure).__name__}: {failure}).", RuntimeWarning)
    if session.output_dir is not None:
        files["report"] = str(session.output_dir / "report.md")
        if (session.output_dir / "events.jsonl").exists():
            files["events"] = str(session.output_dir / "events.jsonl")
        if config.get("save_plots", True):
            files.update(_draw(session.output_dir, session, report))
    files.update(session.links)
    if config.get("print_summary", True):
        try:
            print_summary(report, files)
        except Exception as failure:  # the console is the user's; never break the end of fit
            warnings.warn(f"lightning-debug could not print its summary ({type(failure).__name__}: {failure}).",
                          RuntimeWarning)


def _draw(directory: Path, session: DebugSession, report: dict[str, Any]) -> dict[str, str]:
    from lightning_debug.plots import PlotsUnavailable, write_debug_analysis

    try:
        return {"plots": str(write_debug_analysis(directory, session.timeline, report))}
    except PlotsUnavailable as missing:
        return {"plots": str(missing)}
    except Exception as failure:
        warnings.warn(f"lightning-debug could not draw debug_analysis.png ({type(failure).__name__}: {failure}); "
                      "the report is written.", RuntimeWarning)
        return {}
