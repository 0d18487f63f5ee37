"""report.json (for programs) and report.md (for people), built from what the callbacks hold."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

from lightning_debug.core.events import _jsonable
from lightning_debug.core.findings import SEVERITY_ORDER

REPORT_SCHEMA_VERSION = 1


def build_report(*, status: str, step: int, sections: dict[str, dict[str, Any]], config: dict[str, Any],
                 error: str | None = None) -> dict[str, Any]:
    """Merge the callbacks' sections into one report.

    Each section may hold ``findings`` (a :class:`~lightning_debug.core.findings.Tally` state) and
    ``stats`` (area name -> summary dict); everything else stays under ``sections``.
    """
    from lightning_debug import __version__

    findings: dict[str, dict[str, Any]] = {}
    stats: dict[str, Any] = {}
    for name, section in sections.items():
        for kind, entry in section.get("findings", {}).items():
            findings[kind] = dict(entry, callback=name)
        stats.update(section.get("stats", {}))
    ordered = dict(sorted(findings.items(), key=lambda item: (SEVERITY_ORDER.get(item[1]["severity"], 9),
                                                              item[1]["first_step"])))
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "lightning_debug_version": __version__,
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "error": error,
        "last_step": step,
        "findings": ordered,
        "stats": stats,
        "sections": {name: {k: v for k, v in section.items() if k not in ("findings", "stats")}
                     for name, section in sections.items()},
        "config": config,
    }


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# lightning-debug report", ""]
    status = report["status"]
    lines.append(f"Run status: **{status}** at step {report['last_step']}"
                 + (f" ({report['error']})" if report.get("error") else "") + ".")
    lines.append("")
    findings = report["findings"]
    if not findings:
        lines += ["No problems found.", ""]
    else:
        lines += ["## Findings (most severe first)", ""]
        for kind, entry in findings.items():
            span = (f"step {entry['first_step']}" if entry["first_step"] == entry["last_step"]
                    else f"steps {entry['first_step']}-{entry['last_step']}")
            lines.append(f"- **{kind}** ({entry['severity']}, {entry['episodes']} episode(s), "
                         f"{entry['steps']} check step(s), {span}): {entry['first_message']}")
        lines.append("")
    for name, section in report["sections"].items():
        for title, body in section.get("markdown", {}).items():
            lines += [f"## {title}", "", body.rstrip(), ""]
    if report["stats"]:
        lines += ["## Statistics", "", "| area | count | mean | min | max |", "|---|---|---|---|---|"]
        for area, summary in report["stats"].items():
            if isinstance(summary, dict) and summary.get("count"):
                lines.append(f"| {area} | {summary['count']} | {_number(summary.get('mean'))} | "
                             f"{_number(summary.get('min'))} | {_number(summary.get('max'))} |")
        lines.append("")
    lines += ["Events, one per line: `events.jsonl` beside this file.", ""]
    return "\n".join(lines)


def write_report(directory: Path, report: dict[str, Any]) -> None:
    """Write report.json and report.md; raises OSError for the caller to turn into a warning."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n",
                                           encoding="utf-8")
    (directory / "report.md").write_text(render_markdown(report), encoding="utf-8")
