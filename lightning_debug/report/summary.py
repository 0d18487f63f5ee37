"""The end of a run for a person: ``debug_analysis.png`` and a compact summary on the console.

The summary is meant to be copied: a path or a command is whole on one line, quoted for the shell, and no text
of a run is read as rich markup; colours only on a terminal with rich installed.

Example::

    >>> from lightning_debug.report.summary import summary_lines
    >>> report = {"status": "finished", "last_step": 80, "findings": {"nonfinite_loss": {
    ...     "severity": "error", "first_step": 40, "last_step": 79, "episodes": 1, "steps": 40,
    ...     "first_message": "The loss is NaN/Inf at step 40."}}}
    >>> print("\\n".join(summary_lines(report, {})))
    lightning-debug: run finished at step 80, 1 kind(s) of finding
      severity  finding                where        what
      error     nonfinite_loss         steps 40-79  The loss is NaN/Inf at step 40.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any, TextIO

from lightning_debug.config import DebugConfig
from lightning_debug.core.events import EVENTS_FILENAME
from lightning_debug.core.guard import notify
from lightning_debug.core.context import RunStatus
from lightning_debug.core.kinds import Severity, hint_for
from lightning_debug.core.session import Session
from lightning_debug.report.document import REPORT_JSON, REPORT_MD
from lightning_debug.report.measured import nonfinite_measured, nothing_found, step_span, untrained, unwatched_note

MESSAGE_WIDTH = 110
LINE_MESSAGE_WIDTH = 160
HINT_WIDTH = 90
WARNINGS_PER_SOURCE = 10
SEVERITY_STYLES = {"critical": "bold white on red", "error": "bold red", "warning": "yellow", "info": "dim"}


def _short(message: str, width: int = MESSAGE_WIDTH) -> str:
    """The first sentence, cut at a word to ``width`` characters."""
    first_sentence = message.split(". ")[0].rstrip(".") + "."
    if len(first_sentence) <= width:
        return first_sentence
    return first_sentence[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def _what(entry: dict[str, Any]) -> str:
    """A summary row's text: the first sentence, after "consequence of <kind>:" when it is one."""
    cause = entry.get("consequence_of")
    return (f"consequence of {cause}: " if cause else "") + _short(str(entry["first_message"]))


def finding_line(record: dict[str, Any], printed: Collection[str] = ()) -> str:
    """The one console line of a finding: its first sentence, kind, where, and a hint: the cause a replay named
    (once: a consequence of a kind already ``printed`` says so instead), else the advice's start.

    Example::

        >>> print(finding_line({"step": 40, "epoch": 0, "batch": 40, "kind": "nonfinite_loss", "severity": "error",
        ...     "message": "The loss is NaN/Inf at step 40. Cause: `torch.log` at train.py:12. Common causes: ...",
        ...     "details": {"cause": {"summary": "`torch.log` at train.py:12 (`torch.log(p)`) produced NaN/Inf"}}}))
        lightning-debug: [step 40] The loss is NaN/Inf at step 40 (nonfinite_loss, epoch 0, batch 40). Cause: `torch.log` at train.py:12 (`torch.log(p)`) produced NaN/Inf.
    """
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    cause = details.get("cause") if isinstance(details.get("cause"), dict) else {}
    root = details.get("consequence_of")
    if cause.get("summary") and cause.get("where") not in ("not_reproduced", "error") and root not in printed:
        hint = "Cause: " + _short(str(cause["summary"]), HINT_WIDTH)
    elif root:
        hint = f"Hint: a consequence of {root}; fix that first."
    else:
        advice = hint_for(record.get("kind"))
        hint = f"Hint: {advice}." if advice else ""
    where = f"{record.get('kind')}, epoch {record.get('epoch')}, batch {record.get('batch')}"
    if record.get("optimizer") is not None:
        where += f", optimizer {record['optimizer']}"
    headline = _short(str(record.get("message", "")), LINE_MESSAGE_WIDTH)
    headline = headline if headline.endswith("...") else headline.rstrip(".")
    return f"lightning-debug: [step {record.get('step')}] {headline} ({where}). {hint}".rstrip()


class FindingWarnings:
    """Session event listener: one line per finding of severity warning or above as its episode starts, at most
    ``WARNINGS_PER_SOURCE`` per callback."""

    def __init__(self) -> None:
        self._shown: dict[str, int] = {}
        self._printed: set[str] = set()  # the kinds with a line so far: a consequence of one points at it

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("episode") == "end" or not record.get("console", True):
            return
        if not Severity.parse(record.get("severity")).at_least(Severity.WARNING):
            return
        source = str(record.get("callback", ""))
        shown = self._shown.get(source, 0)
        if shown >= WARNINGS_PER_SOURCE:
            return
        self._shown[source] = shown + 1
        last = shown + 1 == WARNINGS_PER_SOURCE
        notify(finding_line(record, self._printed) + (f" (further findings of {source} are only in events.jsonl)"
                                                      if last else ""))
        self._printed.add(str(record.get("kind")))


def _headline(report: dict[str, Any]) -> str:
    findings = report.get("findings") or {}
    failed = report.get("failed_checks") or {}
    serious = [kind for kind, entry in findings.items()
               if Severity.parse(entry.get("severity")).at_least(Severity.WARNING)]
    notes = len(findings) - len(serious)
    measured = nonfinite_measured(report)
    if serious:
        found = f"{len(serious)} kind(s) of finding"
    elif untrained(report):
        found = "no training batch ran, so nothing was checked"
    elif not nothing_found(report, serious_only=True):  # the one decision (lightning_debug.report.measured)
        found = "no finding, but non-finite values measured"
    else:
        found = ("nothing wrong found" if not failed else "nothing found by the checks that ran") + unwatched_note(report)
    if notes:  # info-level findings: listed, not counted as wrong
        found += f" ({notes} note(s))" if not serious else f" and {notes} note(s)"
    if measured:
        found += f" ({'; '.join(measured)})"
    if failed:
        since = min(int(entry.get("first_step", 0)) for entry in failed.values())
        found += f"; {len(failed)} check(s) failed and did not run (since step {since})"
    status = report.get("status", "?")
    ended = status in (RunStatus.FINISHED, RunStatus.FAILED, RunStatus.INTERRUPTED)
    outcome = f"run {status}" if ended else f"run status {status}"
    return f"lightning-debug: {outcome} at step {report.get('last_step', '?')}, {found}"


def failed_check_lines(report: dict[str, Any]) -> list[str]:
    """One line per check that failed.

    Example::

        >>> failed_check_lines({"failed_checks": {"AnomalyMonitor.finalize": {
        ...     "count": 1, "first_step": 11, "reasons": {"TypeError: odd": 1}}}})
        ['  failed    AnomalyMonitor.finalize since step 11 (1x): TypeError: odd.']
    """
    lines = []
    for name, entry in (report.get("failed_checks") or {}).items():
        reason = next(iter(entry.get("reasons") or {"?": 0}))
        lines.append(f"  {'failed':<9} {name} since step {entry.get('first_step')} ({entry.get('count')}x): "
                     f"{_short(reason)}")
    return lines


def summary_lines(report: dict[str, Any], files: dict[str, str]) -> list[str]:
    """The plain-text summary: a headline, one line per finding kind, per failed check and per file."""
    lines = [_headline(report)]
    if report.get("findings"):
        lines.append(f"  {'severity':<9} {'finding':<22} {'where':<12} what")
    for kind, entry in (report.get("findings") or {}).items():
        lines.append(f"  {entry['severity']:<9} {kind:<22} {step_span(entry):<12} {_what(entry)}")
    lines += failed_check_lines(report)
    for label, where in files.items():
        lines.append(f"  {label + ':':<9} {where}")
    return lines


def print_summary(report: dict[str, Any], files: dict[str, str], stream: TextIO | None = None) -> None:
    """Print the summary: with rich on a terminal when it is installed, else :func:`summary_lines`."""
    stream = stream if stream is not None else sys.stdout
    console = _rich_console(stream)
    if console is None:
        stream.write("\n".join(summary_lines(report, files)) + "\n")
        return
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    findings = report.get("findings") or {}
    console.print(Text(_headline(report), style="bold"), soft_wrap=True)
    if findings:
        table = Table(show_header=True, box=None, padding=(0, 1), expand=False)
        spans = [step_span(entry) for entry in findings.values()]
        widths = [9, max([len(kind) for kind in findings] + [7]), max([len(span) for span in spans] + [5])]
        table.add_column("severity", no_wrap=True, width=widths[0])
        table.add_column("finding", no_wrap=True, width=widths[1])
        table.add_column("where", no_wrap=True, width=widths[2])
        table.add_column("what", no_wrap=True, overflow="ellipsis",
                         width=max(12, console.width - sum(widths) - 9))  # kinds and steps stay whole
        for kind, entry in findings.items():
            severity = str(entry["severity"])
            table.add_row(Text(severity, style=SEVERITY_STYLES.get(severity, "")), Text(kind), Text(step_span(entry)),
                          Text(_what(entry)))
        console.print(table)
    for line in failed_check_lines(report):
        console.print(Text(line, style="bold red"), soft_wrap=True)
    for label, where in files.items():
        console.print(f"  [bold]{escape(label)}:[/] {escape(where)}", soft_wrap=True)


def _rich_console(stream: TextIO) -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console(file=stream, highlight=False, soft_wrap=True)
    return console if console.is_terminal else None


def report_command(directory: Path | str) -> str:
    """The command that rebuilds a run's report and draws its plot, quoted for the shell.

    Example::

        >>> report_command("runs-[exp1]/version_0/debug_outputs")
        "lightning-debug report 'runs-[exp1]/version_0/debug_outputs'"
    """
    return f"lightning-debug report {shlex.quote(str(directory))}"


def conclude_run(session: Session, report: dict[str, Any], config: DebugConfig,
                 attach: Any = None, report_written: bool = True) -> dict[str, str]:
    """Draw the plots, finish the TensorBoard layout, attach the files to the loggers' runs and print the summary
    of the files this run wrote; a step that fails is recorded and the others go on. Returns the files listed."""
    files: dict[str, str] = {}
    failures = session.failures
    directory = session.output_dir
    if directory is not None:
        if config.save_plots and plot_worth_drawing(report):
            files.update(failures.call("drawing debug_analysis.png", _draw, directory, session, report) or {})
        elif config.save_plots:
            files["debug_analysis.png"] = (f"not drawn (a healthy run of {report.get('last_step', 0)} steps; drawn "
                                           f"with a finding or from {PLOT_MIN_STEPS} steps): "
                                           f"{report_command(directory)}")
        documents = (("report", REPORT_MD), ("json", REPORT_JSON)) if report_written else ()
        for label, name in (*documents, ("events", EVENTS_FILENAME)):
            if (directory / name).is_file():
                files[label] = str(directory / name)
    written = [Path(path) for path in files.values() if Path(path).is_file()]
    for listener in session.event_listeners:
        conclude = getattr(listener, "conclude", None)
        if callable(conclude):
            failures.call(f"finishing {type(listener).__name__}", conclude, session, written)
    if attach is not None and written:
        for target in failures.call("attaching the report to the loggers' runs", attach, written) or []:
            files.setdefault("attached", target)
    files.update(session.links)
    if config.print_summary:
        failures.call("printing the summary", print_summary, report, files)
    return files


PLOT_MIN_STEPS = 200  # from this many optimizer steps a healthy run's debug_analysis.png is drawn


def plot_worth_drawing(report: dict[str, Any]) -> bool:
    """Whether the end of fit draws debug_analysis.png: drawing costs about half a second, so a short healthy fit
    skips it.

    Example::

        >>> plot_worth_drawing({"status": "finished", "last_step": 20, "findings": {}})
        False
        >>> plot_worth_drawing({"status": "finished", "last_step": 20, "findings": {"loss_spike": {"severity": "warning"}}})
        True
        >>> plot_worth_drawing({"status": "finished", "last_step": PLOT_MIN_STEPS, "findings": {}})
        True
    """
    if untrained(report):
        return False
    if not nothing_found(report, serious_only=True):
        return True
    return str(report.get("status", "finished")) != "finished" or int(report.get("last_step") or 0) >= PLOT_MIN_STEPS


def _draw(directory: Path, session: Session, report: dict[str, Any]) -> dict[str, str]:
    from lightning_debug.report.plots import INSTALL_HINT, PlotsUnavailable, write_debug_analysis

    try:
        return {"plots": str(write_debug_analysis(directory, session.timeline, report))}
    except PlotsUnavailable:
        return {"plots": f"not drawn, matplotlib is not installed: {INSTALL_HINT}, then {report_command(directory)}"}
