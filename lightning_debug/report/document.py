"""report.json (for programs) and report.md (for people), built from what the monitors hold.

report.json's top-level keys are stable (``schema_version`` changes if one ever has to change):

- ``schema_version`` (int), ``lightning_debug_version`` (str), ``generated`` (ISO-8601 UTC)
- ``run``: the run id its events carry (null for a report rebuilt from events without one)
- ``status``: ``finished``, ``failed``, ``interrupted`` (or ``unknown`` for a report rebuilt
  offline from a run that never wrote one), ``error`` (the exception, or null), ``last_step``
- ``findings``: kind -> ``{episodes, steps, first_step, last_step, severity, first_message,
  callback}`` and ``consequence_of`` (the kind it follows from) when it is a consequence; root causes
  most severe first, then by first step and causal order, each consequence right after its cause
- ``stats``: area (``gradient_norm``, ``step_time_ms``, ``memory/cpu_rss_mb``, ...) -> ``{count, mean,
  min, max, ...}``
- ``sections``: area -> what else its monitor reports (tables, suggestions, and the ``markdown``
  of its report.md sections)
- ``failed_checks``: check -> ``{count, first_step, last_step, reasons}`` for every check that
  raised instead of running (empty when every check ran)
- ``config``: the DebugConfig, enums by name

A report rebuilt by ``lightning-debug report DIR`` adds ``rebuilt`` (the files it was read from).

Example::

    >>> report = build_report(status="finished", step=3, sections={}, config={})
    >>> print(render_markdown(report).splitlines()[2])
    Run status: **finished** at step 3.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_debug._version import __version__
from lightning_debug.checks.gradients import round_significant
from lightning_debug.checks.memory import PHASES as MEMORY_PHASES
from lightning_debug.checks.memory import SERIES_LABELS
from lightning_debug.checks.timing import PHASES
from lightning_debug.core.events import jsonable
from lightning_debug.core.findings import order_findings
from lightning_debug.core.context import RunStatus
from lightning_debug.core.kinds import advice_for, severity_rank

REPORT_SCHEMA_VERSION = 1
REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def build_report(*, status: RunStatus | str, step: int, sections: dict[str, dict[str, Any]], config: dict[str, Any],
                 error: str | None = None, failures: dict[str, Any] | None = None,
                 run_id: str | None = None) -> dict[str, Any]:
    """Merge the monitors' sections into one report.

    Each section may hold ``findings`` (a :class:`~lightning_debug.core.findings.Tally` state) and
    ``stats`` (area name -> summary dict); everything else stays under ``sections``, with the
    Markdown of the area's report.md sections added as ``markdown``.
    """
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
            section["markdown"] = render(dict(section, stats=sections[name].get("stats", {})))
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "lightning_debug_version": __version__,
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run": run_id,
        "status": RunStatus.parse(status).value,
        "error": error,
        "last_step": step,
        "findings": sort_findings(findings),
        "stats": stats,
        "sections": kept,
        "failed_checks": dict(failures or {}),
        "config": config,
    }


def sort_findings(findings: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Root causes first, each consequence right after its cause (see :func:`~lightning_debug.core.findings.order_findings`)."""
    return order_findings(findings)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _span(entry: dict[str, Any]) -> str:
    if entry["first_step"] == entry["last_step"]:
        return f"step {entry['first_step']}"
    return f"steps {entry['first_step']}-{entry['last_step']}"


def failed_checks_markdown(failed: dict[str, dict[str, Any]]) -> list[str]:
    """The checks that raised instead of running, as Markdown lines (report.md and TensorBoard).

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
    """report.md: the status, then each finding (root causes first, most severe first, each consequence after
    its cause) with where it was and what to do."""
    lines = ["# lightning-debug report", ""]
    status = report["status"]
    lines.append(f"Run status: **{status}** at step {report['last_step']}"
                 + (f" ({report['error']})" if report.get("error") else "") + ".")
    lines.append("")
    failed = report.get("failed_checks") or {}
    findings = report["findings"]
    if not findings:
        lines += ["No problems found." if not failed else
                  "No problems found by the checks that ran; some checks did not run (below).", ""]
    else:
        by_severity: dict[str, int] = {}
        for entry in findings.values():
            by_severity[entry["severity"]] = by_severity.get(entry["severity"], 0) + 1
        counts = ", ".join(f"{count} {severity}" for severity, count in
                           sorted(by_severity.items(), key=lambda item: severity_rank(item[0])))
        lines += [f"Found {len(findings)} kind(s) of problem: {counts}.", "",
                  "## Findings (root causes first, most severe first)", ""]
        for number, (kind, entry) in enumerate(findings.items(), start=1):
            cause = entry.get("consequence_of") if entry.get("consequence_of") in findings else None
            lines += [f"### {number}. `{kind}` ({entry['severity']}" + (f", consequence of `{cause}`" if cause
                                                                        else "") + ")", "",
                      f"- **Where**: {_span(entry)}; {entry['episodes']} episode(s) over {entry['steps']} check "
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
                lines.append(f"| {area} | {summary['count']} | {_number(summary.get('mean'))} | "
                             f"{_number(summary.get('min'))} | {_number(summary.get('max'))} |")
        lines.append("")
    rebuilt = report.get("rebuilt")
    if rebuilt:
        skipped = f" ({rebuilt['bad_lines']} malformed line(s) skipped)" if rebuilt.get("bad_lines") else ""
        lines += [f"Rebuilt offline by `lightning-debug report` from {rebuilt.get('events') or 'no events file'}"
                  f"{skipped} and {len(rebuilt.get('tensorboard', []))} TensorBoard file(s).", ""]
    lines += ["Beside this file: `events.jsonl` (one event per line) and, with matplotlib installed, "
              "`debug_analysis.png` (step time, memory, gradient norm and findings over steps).", ""]
    return "\n".join(lines)


# --- the areas' sections of report.md -------------------------------------------------------------
def _significant(summary: dict[str, Any], key: str) -> Any:
    return round_significant(summary[key], 3) if summary.get("count") else "-"


def gradients_markdown(section: dict[str, Any]) -> dict[str, str]:
    norms = section.get("stats", {}).get("gradient_norm", {})
    lines = [f"{section['checks']} check step(s), every {section['check_frequency']} optimizer step(s)."]
    if norms.get("count"):
        lines.append(f"Global gradient norm: mean {norms['mean']:.4g}, min {norms['min']:.4g}, "
                     f"max {norms['max']:.4g}, last {norms['last']:.4g}.")
    counts = section["counts"]
    lines.append(f"Check steps with exploding gradients: {counts['exploding_checks']}, vanishing: "
                 f"{counts['vanishing_checks']}, missing: {counts['missing_checks']}, not updated: "
                 f"{counts['frozen_checks']}.")
    clip = section.get("clip_suggestion")
    if clip and clip.get("value") is not None:
        lines.append(f"Suggested clipping: `Trainer(gradient_clip_val={clip['value']:g})` ({clip['basis']}).")
    elif clip:
        lines.append(f"No clip value suggested: {clip['basis']}.")
    frozen = section.get("trainability", {}).get("requires_grad_false_parameters", 0)
    if frozen:
        lines.append(f"{frozen} parameter(s) have requires_grad=False (not trained by design).")
    flagged = section.get("most_flagged") or {}
    if flagged:
        lines += ["", "| kind | parameter | check steps flagged |", "|---|---|---|"]
        for kind, rows in flagged.items():
            lines += [f"| {kind} | `{name}` | {hits} |" for name, hits in rows]
    parameter_norms = section.get("parameter_norms")
    if parameter_norms:
        largest = sorted(parameter_norms.items(), key=lambda item: -item[1].get("max", -math.inf))[:20]
        lines += ["", "| parameter | mean grad norm | min | max |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {_significant(s, 'mean')} | {_significant(s, 'min')} | {_significant(s, 'max')} |"
                  for name, s in largest]
    return {"Gradient health": "\n".join(lines)}


def memory_markdown(section: dict[str, Any]) -> dict[str, str]:
    stats = section.get("stats", {})
    readings = stats.get("memory/cpu_rss_mb", {}).get("count", 0)
    lines = [f"Measured every {section['check_frequency']} optimizer steps ({readings} readings).", ""]
    if stats:
        lines += ["| reading | last | mean | min | max |", "|---|---|---|---|---|"]
        for name, summary in stats.items():
            lines.append(f"| {name.removeprefix('memory/')} | {summary['last']:.4g} | {summary['mean']:.4g} | "
                         f"{summary['min']:.4g} | {summary['max']:.4g} |")
        lines.append("")
    growth = section.get("growth", {})
    status = growth.get("status")
    if status == "growing":
        lines.append(f"**Growth: yes.** {growth.get('message', '')}")
    else:
        shown = "; ".join(f"{SERIES_LABELS[name]} {trend['per_step'] * 1024:+.2f} KB/step (tau "
                          f"{trend['consistency']:.2f})" for name, trend in growth.get("trends", {}).items())
        lines.append(f"**Growth: {status}.**" + (f" Last trends: {shown}." if shown else ""))
    phases = section.get("phases") or {}
    if phases:
        on_cuda = section.get("phase_reading") == "cuda_peak"
        lines += ["", "| phase | " + ("peak allocated MB" if on_cuda else "CPU heap in use at its end, MB")
                  + " (max) | mean |", "|---|---|---|"]
        order = list(MEMORY_PHASES)
        for name in sorted(phases, key=lambda n: order.index(n) if n in order else len(order)):
            lines.append(f"| {name} | {phases[name]['max']:.4g} | {phases[name]['mean']:.4g} |")
    census = section.get("cost_ms", {}).get("census", {})
    if census.get("count"):
        lines += ["", f"Tensor censuses taken to explain growth: {census['count']} (mean {census['mean']:.0f} ms)."]
    for path in section.get("oom_post_mortems", []):
        lines += ["", f"Out-of-memory post-mortem: `{path}`."]
    return {"Memory": "\n".join(lines)}


def phase_table_markdown(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Mean, median, p90 and max of each phase, and its share of the mean step time.

    Example::

        >>> print(phase_table_markdown({"step": {"count": 2, "mean": 10.0, "median": 10.0, "p90": 11.0,
        ...                                      "max": 11.0},
        ...                             "data": {"count": 2, "mean": 4.0, "median": 4.0, "p90": 5.0, "max": 5.0}}))
        | phase | mean ms | median ms | p90 ms | max ms | share of step |
        |---|---|---|---|---|---|
        | step | 10.00 | 10.00 | 11.00 | 11.00 | 100.0% |
        | data | 4.00 | 4.00 | 5.00 | 5.00 | 40.0% |
    """
    step_mean = summaries.get("step", {}).get("mean") or math.nan
    lines = ["| phase | mean ms | median ms | p90 ms | max ms | share of step |", "|---|---|---|---|---|---|"]
    for phase, summary in summaries.items():
        if not summary.get("count"):
            continue
        share = summary["mean"] / step_mean if step_mean and math.isfinite(step_mean) else math.nan
        share_text = f"{100.0 * share:.1f}%" if math.isfinite(share) else "-"
        lines.append(f"| {phase} | {summary['mean']:.2f} | {summary['median']:.2f} | {summary['p90']:.2f} | "
                     f"{summary['max']:.2f} | {share_text} |")
    return "\n".join(lines)


def operators_markdown(rows: list[dict[str, Any]], by: str = "self_cpu_ms") -> str:
    """A Markdown table of top-operator rows (``OperatorRow`` fields), with each one's share of the listed time.

    Example::

        >>> print(operators_markdown([{"name": "aten::mm", "calls": 4, "self_cpu_ms": 0.9, "cpu_total_ms": 0.9,
        ...                            "self_device_ms": 0.0}]))
        | operator | calls | self CPU ms | CPU total ms | self CUDA ms | share |
        |---|---|---|---|---|---|
        | `aten::mm` | 4 | 0.900 | 0.900 | 0.000 | 100.0% |
    """
    total = sum(row[by] for row in rows) or 1.0
    lines = ["| operator | calls | self CPU ms | CPU total ms | self CUDA ms | share |", "|---|---|---|---|---|---|"]
    for row in rows:
        name = str(row["name"]).replace("|", "\\|")
        lines.append(f"| `{name}` | {row['calls']} | {row['self_cpu_ms']:.3f} | {row['cpu_total_ms']:.3f} | "
                     f"{row['self_device_ms']:.3f} | {100.0 * row[by] / total:.1f}% |")
    return "\n".join(lines)


def performance_markdown(section: dict[str, Any]) -> dict[str, str]:
    stats = section.get("stats", {})
    summaries = {name: stats.get(f"{name}_time_ms", {}) for name in ("step", *(phase.value for phase in PHASES))}
    markdown: dict[str, str] = {}
    if summaries["step"].get("count"):
        markdown["Step time"] = (
            f"Every {section['check_frequency']} optimizer step(s), {section['clock']}; "
            f"{summaries['step']['count']} steps measured (median and p90 over a bounded sample).\n\n"
            + phase_table_markdown(summaries))
    for trace in section.get("profiler_traces", []):
        title = f"Top operators (torch.profiler, steps {trace['first_step']}-{trace['last_step']})"
        body = f"Trace: `{trace['path']}`\n\nBy self CPU time:\n\n{operators_markdown(trace['by_self_cpu'])}\n"
        if trace["by_self_device"]:
            body += f"\nBy self CUDA time:\n\n{operators_markdown(trace['by_self_device'], 'self_device_ms')}\n"
        markdown[title] = body
    sites = section.get("sync_sites")
    if sites:
        markdown["Host-device synchronizations (EXPERT window)"] = "\n".join(
            ["| where | code | count | origin |", "|---|---|---|---|"]
            + [f"| {s['file']}:{s['line']} | `{s['code']}` | {s['count']} | {s['origin']} |" for s in sites])
    return markdown


def anomaly_markdown(section: dict[str, Any]) -> dict[str, str]:
    """The batches that held NaN/Inf (``nonfinite_input``), with their samples; nothing when there were none."""
    rows = section.get("nonfinite_inputs") or []
    if not rows:
        return {}
    lines = ["| step | epoch | batch | rank | tensor | shape | samples | NaN/Inf values |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row.get('step')} | {row.get('epoch')} | {row.get('batch')} | {row.get('rank', 0)} | "
              f"`{row.get('tensor')}` | {row.get('shape')} | {row.get('samples')} | {row.get('count')} |"
              for row in rows]
    return {"Batches with NaN/Inf": "\n".join(lines)}


def activations_markdown(section: dict[str, Any]) -> dict[str, str]:
    """The modules flagged dead or saturated, and the last check's statistics per module."""
    lines = [f"{section.get('checks', 0)} check step(s), every {section['check_frequency']} optimizer step(s); "
             "statistics of each leaf module's output (one row per call)."]
    flagged = section.get("flagged") or {}
    if flagged:
        lines += ["", "| finding | module | check steps flagged |", "|---|---|---|"]
        lines += [f"| {kind} | `{name}` | {count} |"
                  for kind, counts in flagged.items() for name, count in counts.items()]
    latest = section.get("latest") or {}
    if latest:
        lines += ["", f"At step {section.get('latest_step')}:", "",
                  "| module | type | shape | mean | std | max abs | zeros | saturated | non-finite |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, stats in latest.items():
            saturated = stats.get("saturated_fraction")
            lines.append(f"| `{name}` | {stats.get('type')} | {stats.get('shape')} | {_number(stats.get('mean'))} | "
                         f"{_number(stats.get('std'))} | {_number(stats.get('max_abs'))} | "
                         f"{_number(stats.get('zero_fraction'))} | "
                         f"{'-' if saturated is None else _number(saturated)} | "
                         f"{_number(stats.get('nonfinite_count'))} |")
    return {"Activations": "\n".join(lines)}


def loop_markdown(section: dict[str, Any]) -> dict[str, str]:
    """Modules left in eval mode and parameters whose gradients were not zeroed; nothing when neither happened."""
    lines: list[str] = []
    for name, affected in (section.get("eval_modules") or {}).items():
        lines.append(f"- `{name or '(the whole model)'}` was in eval mode during training; affected layers: "
                     + ", ".join(f"`{layer}`" for layer in affected))
    accumulating = section.get("accumulating") or []
    if accumulating:
        lines.append("- Gradients not zeroed between optimizer steps for: "
                     + ", ".join(f"`{name}`" for name in accumulating))
    return {"Training loop": "\n".join(lines)} if lines else {}


def exception_markdown(explanation: dict[str, Any]) -> str:
    """One explained exception: what the plugin could name, the fix, and PyTorch's own message."""
    details = explanation.get("details") or {}
    lines = [f"### `{explanation['category']}` at step {explanation['step']}", "", explanation["message"], "",
             f"**What to do**: {explanation['advice']}"]
    source = details.get("source")
    if source:
        lines += ["", f"Innermost line of your code: `{source['file']}:{source['line']}` `{source['code']}`"]
    lines += ["", "```", str(details.get("error", "")).strip()[:2000], "```"]
    return "\n".join(lines)


def errors_markdown(section: dict[str, Any]) -> dict[str, str]:
    explanations = section.get("explanations") or []
    if not explanations:
        return {}
    return {"Runtime error": "\n\n".join(exception_markdown(explanation) for explanation in explanations)}


SECTION_MARKDOWN: dict[str, Callable[[dict[str, Any]], dict[str, str]]] = {
    "anomaly": anomaly_markdown, "gradients": gradients_markdown, "activations": activations_markdown,
    "memory": memory_markdown, "performance": performance_markdown, "loop": loop_markdown,
    "errors": errors_markdown,
}


# --- files ----------------------------------------------------------------------------------------
def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``path`` whole or not at all: into a temporary file in the same directory, flushed to disk,
    then renamed over ``path``. A full disk leaves the previous complete version (and no temporary
    file); a symlink at ``path`` is replaced, never followed, so nothing outside the directory is written.

    Example::

        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "report.json"
        >>> write_atomic(target, "{}").read_text(), sorted(p.name for p in target.parent.iterdir())
        ('{}', ['report.json'])
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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
    """Write report.json and report.md, each atomically (:func:`write_atomic`); raises for the caller to
    record as a failed write."""
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
