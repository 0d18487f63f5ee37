"""report.json (for programs) and report.md (for people), built from what the monitors hold.

report.json's top-level keys are stable (``schema_version`` changes if one ever has to).

Example::

    >>> report = build_report(status="finished", step=3, sections={}, config={})
    >>> print(render_markdown(report).splitlines()[2])
    Run status: **finished** at step 3.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_debug._version import __version__
from lightning_debug.core.context import RunStatus
from lightning_debug.core.events import jsonable
from lightning_debug.core.findings import order_findings
from lightning_debug.core.kinds import advice_for, severity_rank
from lightning_debug.report.measured import (UNTRAINED, measured_line, nothing_found, step_span, untrained,
                                              unwatched_sentence)
from lightning_debug.report.sections import SECTION_MARKDOWN, exception_markdown, number_text

REPORT_SCHEMA_VERSION = 1
REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def build_report(*, status: RunStatus | str, step: int, sections: dict[str, dict[str, Any]], config: dict[str, Any],
                 error: str | None = None, failures: dict[str, Any] | None = None,
                 run_id: str | None = None,
                 on_render_failure: Callable[[str, Exception], None] | None = None) -> dict[str, Any]:
    """Merge the monitors' sections into one report. A section whose Markdown cannot be rendered is left without
    it and given to ``on_render_failure``: one area's odd section never costs the whole report."""
    findings: dict[str, dict[str, Any]] = {}
    stats: dict[str, Any] = {}
    for name, section in sections.items():
        for kind, entry in section.get("findings", {}).items():
            findings[kind] = dict(entry, callback=name)
        stats.update(section.get("stats", {}))
    kept = {name: {k: v for k, v in section.items() if k not in ("findings", "stats")}
            for name, section in sections.items()}
    for name, section in kept.items():
        render = SECTION_MARKDOWN.get(name)
        if render is not None and "error" not in section:
            try:
                section["markdown"] = render(dict(section, stats=sections[name].get("stats", {})))
            except Exception as failure:
                if on_render_failure is None:
                    raise
                on_render_failure(name, failure)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "lightning_debug_version": __version__,
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run": run_id,
        "status": RunStatus.parse(status).value,
        "error": error,
        "last_step": step,
        "findings": order_findings(findings),
        "stats": stats,
        "sections": kept,
        "failed_checks": dict(failures or {}),
        "config": config,
    }


def moment(seconds: float) -> str:
    """A time as report.json writes the run's span: UTC, to the millisecond, so the offline report can tell two
    runs a second apart in one TensorBoard file.

    Example::

        >>> moment(0.25)
        '1970-01-01T00:00:00.250+00:00'
    """
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="milliseconds")


def failed_checks_markdown(failed: dict[str, dict[str, Any]]) -> list[str]:
    """The checks that raised instead of running, as Markdown lines.

    Example::

        >>> print("\\n".join(failed_checks_markdown({"GradientMonitor.before_optimizer_step": {
        ...     "count": 3, "first_step": 7, "reasons": {"TypeError: odd tensor": 3}}})))
        These checks raised instead of running; what they would have found is not in this report.
        <BLANKLINE>
        | check | failures | since step | reason |
        |---|---|---|---|
        | GradientMonitor.before_optimizer_step | 3 | 7 | TypeError: odd tensor |
    """
    lines = ["These checks raised instead of running; what they would have found is not in this report.", "",
             "| check | failures | since step | reason |", "|---|---|---|---|"]
    for name, entry in failed.items():
        reason = next(iter(entry.get("reasons") or {"?": 0}))
        lines.append(f"| {name} | {entry.get('count')} | {entry.get('first_step')} | {reason.replace('|', '/')[:200]} |")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the status, then each finding (root causes first, most severe first) with where it was and what
    to do. What a callback measured non-finite is stated under the headline whatever the findings."""
    lines = ["# lightning-debug report", ""]
    status = report["status"]
    lines.append(f"Run status: **{status}** at step {report['last_step']}"
                 + (f" ({report['error']})" if report.get("error") else "") + ".")
    lines.append("")
    failed = report.get("failed_checks") or {}
    findings = report["findings"]
    measured = measured_line(report)
    if nothing_found(report):
        scope = unwatched_sentence(report)
        lines += ["No problems found." if not failed else
                  "No problems found by the checks that ran; some checks did not run (below).", ""]
        lines += [scope, ""] if scope else []
    elif not findings:
        lines += [UNTRAINED if untrained(report) and measured is None else str(measured), ""]
    else:
        by_severity = Counter(entry["severity"] for entry in findings.values())
        counts = ", ".join(f"{count} {severity}" for severity, count in
                           sorted(by_severity.items(), key=lambda item: severity_rank(item[0])))
        lines += [f"Found {len(findings)} kind(s) of problem: {counts}.", ""]
        lines += [measured, ""] if measured else []
        lines += ["## Findings (root causes first, most severe first)", ""]
        for number, (kind, entry) in enumerate(findings.items(), start=1):
            cause = entry.get("consequence_of") if entry.get("consequence_of") in findings else None
            lines += [f"### {number}. `{kind}` ({entry['severity']}" + (f", consequence of `{cause}`" if cause
                                                                        else "") + ")", "",
                      f"- **Where**: {step_span(entry)}; {entry['episodes']} episode(s) over {entry['steps']} check "
                      f"step(s); reported by `{entry.get('callback', '?')}`.",
                      f"- **What**: {entry['first_message']}"]
            if entry.get("source") == "tensorboard":
                lines.append("- **Source**: the TensorBoard scalars; events.jsonl has no event of it (missing, cut "
                             "off or lost lines), so details such as parameter names are not known.")
            advice = (f"This follows from `{cause}` above; fix that first." if cause is not None
                      else advice_for(kind))
            if advice:
                lines.append(f"- **What to do**: {advice}")
            lines.append("")
    if failed:
        lines += ["## Checks that failed", "", *failed_checks_markdown(failed), ""]
    for section in report["sections"].values():
        for title, body in section.get("markdown", {}).items():
            lines += [f"## {title}", "", body.rstrip(), ""]
    if report["stats"]:
        lines += ["## Statistics", "", "| area | count | mean | min | max |", "|---|---|---|---|---|"]
        for area, summary in report["stats"].items():
            if isinstance(summary, dict) and summary.get("count"):
                lines.append(f"| {area} | {summary['count']} | {number_text(summary.get('mean'))} | "
                             f"{number_text(summary.get('min'))} | {number_text(summary.get('max'))} |")
        lines.append("")
    rebuilt = report.get("rebuilt")
    if rebuilt:
        skipped = f" ({rebuilt['bad_lines']} malformed line(s) skipped)" if rebuilt.get("bad_lines") else ""
        lines += [f"Rebuilt offline by `lightning-debug report` from {rebuilt.get('events') or 'no events file'}"
                  f"{skipped} and {len(rebuilt.get('tensorboard', []))} TensorBoard file(s).", ""]
    lines += ["Beside this file: `events.jsonl` (one event per line) and, with matplotlib installed, "
              "`debug_analysis.png` (the loss, step time, memory, gradient norm and findings over steps).", ""]
    return "\n".join(lines)


# --- files ----------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process's umask (from /proc where it can be, so no other thread sees it changed)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``path`` whole or not at all (a temporary file in the same directory, flushed, renamed over it): a
    full disk leaves the previous version; a symlink at ``path`` is replaced, never followed.

    Example::

        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "report.json"
        >>> write_atomic(target, "{}").read_text(), sorted(p.name for p in target.parent.iterdir())
        ('{}', ['report.json'])
    """
    # a lone surrogate (a path that is not UTF-8, a hostile file's "\udcff") is written as its escape
    payload = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, 0o666 & ~current_umask())  # mkstemp's 0600 -> what open() gives events.jsonl
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def write_report(directory: Path, report: dict[str, Any]) -> None:
    """Write report.json and report.md, each atomically; raises for the caller to record."""
    json_text = json.dumps(jsonable(report), indent=2, allow_nan=False) + "\n"
    markdown = render_markdown(report)
    write_atomic(directory / REPORT_JSON, json_text)
    write_atomic(directory / REPORT_MD, markdown)


def post_mortem_markdown(document: dict[str, Any]) -> str:
    """The ``oom_step<N>.md`` file of an out-of-memory post-mortem."""
    lines = [f"# Out of memory at step {document['step']} (during {document['phase']})", "", "```",
             document["error"].strip(), "```", "", "## What to try", ""]
    lines += [f"- {fix}" for fix in document["fixes"]]
    lines += ["", "## Memory at the failure", ""]
    lines += [f"- {name}: {value:.1f}" for name, value in document["memory_mb"].items()]
    lines += ["", "## The batch", ""]
    lines += [f"- {line}" for line in document["batch"]] or ["- (not known)"]
    lines += ["", "## Largest live tensors", "", "| shape | dtype | device | grad_fn | count | MB |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {row['shape']} | {row['dtype']} | {row['device']} | {row['grad_fn'] or ''} | {row['count']} | "
              f"{row['mb']:.2f} |" for row in document["largest_tensors"]]
    if document.get("snapshot"):
        lines += ["", "## Allocation history", "",
                  f"`{document['snapshot']}`: drag it onto https://pytorch.org/memory_viz to see every allocation "
                  "with its stack."]
    if document.get("cuda_memory_summary"):
        lines += ["", "## torch.cuda.memory_summary()", "", "```", document["cuda_memory_summary"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def exception_document(document: dict[str, Any]) -> str:
    """The ``exception_step<N>_rank<r>.md`` file a rank other than zero writes for its own error."""
    return f"# Runtime error at step {document['step']}\n\n{exception_markdown(document)}\n"


DOCUMENTS: dict[str, Callable[[dict[str, Any]], str]] = {"oom_post_mortem": post_mortem_markdown,
                                                         "exception": exception_document}


def write_document(directory: Path, name: str, document: dict[str, Any]) -> Path:
    """Render a monitor's document (``document["document"]`` names its kind) to ``directory/name.md``."""
    return write_atomic(directory / f"{name}.md", DOCUMENTS[document["document"]](document))
