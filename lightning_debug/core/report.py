"""report.json (for programs) and report.md (for people), built from what the callbacks hold.

report.json's top-level keys are stable (``schema_version`` changes if one ever has to change):

- ``schema_version`` (int), ``lightning_debug_version`` (str), ``generated`` (ISO-8601 UTC)
- ``status``: ``finished``, ``failed``, ``interrupted`` (or ``unknown`` for a report rebuilt
  offline from a run that never wrote one), ``error`` (the exception, or null), ``last_step``
- ``findings``: kind -> ``{episodes, steps, first_step, last_step, severity, first_message,
  callback}``, most severe first, then by first step
- ``stats``: area (``gradient_norm``, ``step_time_ms``, ``memory/cpu_rss_mb``, ...) -> ``{count, mean,
  min, max, ...}``
- ``sections``: callback area -> what else its monitor reports (tables, suggestions, markdown)
- ``config``: the DebugConfig, enums by name

A report rebuilt by ``lightning-debug report DIR`` adds ``rebuilt`` (the files it was read from).
"""

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


ADVICE: dict[str, str] = {
    "nonfinite_loss": "Find the operation that produces it: a log or division of a value that reaches 0 "
                      "(add an epsilon or clamp), sqrt of a negative, a learning rate too high, NaN in the input "
                      "batch. `level: EXPERT` runs backward under `torch.autograd.set_detect_anomaly` to name the "
                      "operation; `anomaly_detection_mode: skip` keeps training past rare bad batches.",
    "nonfinite_grad": "With a finite loss the backward pass is at fault (sqrt/pow/norm at 0, division by a tiny "
                      "value, an overflow): clamp inputs of those operations, clip gradients "
                      "(`Trainer(gradient_clip_val=1.0)`), lower the learning rate.",
    "nonfinite_param": "The weights are already broken; skipping steps cannot repair them. Restart from the last "
                       "good checkpoint with a lower learning rate, gradient clipping, and check weight decay and "
                       "fp16 loss scaling.",
    "nonfinite_activation": "A layer's output is not finite: look at the named module's inputs and its "
                            "normalisation; clamp or add epsilons where it divides, logs or exponentiates.",
    "amp_overflow_skipped": "Nothing to do unless it happens on most steps; then values overflow fp16: scale "
                            "inputs down or train in bf16.",
    "exploding_grad": "Clip gradients (`Trainer(gradient_clip_val=...)`, see the suggestion under Gradient health), "
                      "lower the learning rate, use a learning-rate warm-up, check initialisation and normalisation.",
    "vanishing_grad": "Gradients do not reach these layers: prefer ReLU/GELU to saturating sigmoid/tanh, use "
                      "xavier/kaiming initialisation, normalisation layers or residual connections; check that the "
                      "loss is not detached or scaled to nothing.",
    "missing_grad": "A trainable parameter got no gradient: a layer defined but not used in forward, a branch cut "
                    "by `.detach()`/`.item()`/`torch.no_grad()`, or an output left out of the loss. Use it, remove "
                    "it, or set `requires_grad=False` (under DDP it also needs `find_unused_parameters`).",
    "frozen_param": "The optimizer cannot move these parameters: add them to the optimizer's param groups, check "
                    "for a learning rate of 0, or set `requires_grad=False` if they are frozen on purpose.",
    "memory_growth": "Memory grows step after step: a tensor kept across steps together with its graph "
                     "(`losses.append(loss)` instead of `loss.item()` or `loss.detach()`), a cache or list that "
                     "only grows, or gradients accumulated without `zero_grad()`.",
    "memory_high": "Close to the limit: reduce the batch size, accumulate gradients, use mixed precision or "
                   "activation checkpointing, and free tensors you keep between steps.",
    "oom": "Out of memory: see the post-mortem for what held the memory; reduce the batch size, accumulate "
           "gradients, use mixed precision or activation checkpointing.",
    "slow_step": "See which phase was slow (data, forward, backward, optimizer): a checkpoint save, garbage "
                 "collection, validation, or a host sync; `profile_steps` records a torch.profiler trace.",
    "dataloader_bottleneck": "The model waits for data: raise `num_workers`, set `pin_memory=True` on GPU and "
                             "`persistent_workers=True`, and move heavy preprocessing out of `__getitem__`.",
    "straggler_rank": "One rank is consistently slower: check its data shard, its device (clocks, temperature) "
                      "and other jobs on that node.",
    "host_sync": "Keep values on the device inside the step: log tensors instead of `.item()`, and do not print "
                 "or branch on tensor values.",
    "profiler_trace": "Open the trace in https://ui.perfetto.dev, chrome://tracing or TensorBoard's profiler "
                      "plugin; the top operators are listed below.",
}


def _span(entry: dict[str, Any]) -> str:
    if entry["first_step"] == entry["last_step"]:
        return f"step {entry['first_step']}"
    return f"steps {entry['first_step']}-{entry['last_step']}"


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the status, then each finding (most severe first) with where it was and what to do."""
    lines = ["# lightning-debug report", ""]
    status = report["status"]
    lines.append(f"Run status: **{status}** at step {report['last_step']}"
                 + (f" ({report['error']})" if report.get("error") else "") + ".")
    lines.append("")
    findings = report["findings"]
    if not findings:
        lines += ["No problems found.", ""]
    else:
        by_severity: dict[str, int] = {}
        for entry in findings.values():
            by_severity[entry["severity"]] = by_severity.get(entry["severity"], 0) + 1
        counts = ", ".join(f"{count} {severity}" for severity, count in
                           sorted(by_severity.items(), key=lambda item: SEVERITY_ORDER.get(item[0], 9)))
        lines += [f"Found {len(findings)} kind(s) of problem: {counts}.", "",
                  "## Findings (most severe first)", ""]
        for number, (kind, entry) in enumerate(findings.items(), start=1):
            lines += [f"### {number}. `{kind}` ({entry['severity']})", "",
                      f"- **Where**: {_span(entry)}; {entry['episodes']} episode(s) over {entry['steps']} check "
                      f"step(s); reported by `{entry.get('callback', '?')}`.",
                      f"- **What**: {entry['first_message']}"]
            if kind in ADVICE:
                lines.append(f"- **What to do**: {ADVICE[kind]}")
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
    rebuilt = report.get("rebuilt")
    if rebuilt:
        lines += [f"Rebuilt offline by `lightning-debug report` from {rebuilt.get('events') or 'no events file'} "
                  f"and {len(rebuilt.get('tensorboard', []))} TensorBoard file(s).", ""]
    lines += ["Beside this file: `events.jsonl` (one event per line) and, with matplotlib installed, "
              "`debug_analysis.png` (step time, memory, gradient norm and findings over steps).", ""]
    return "\n".join(lines)


def write_report(directory: Path, report: dict[str, Any]) -> None:
    """Write report.json and report.md; raises OSError for the caller to turn into a warning."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n",
                                           encoding="utf-8")
    (directory / "report.md").write_text(render_markdown(report), encoding="utf-8")
