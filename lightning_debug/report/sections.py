"""The areas' sections of report.md: one function per area turns its report section into Markdown (title -> body),
printed after the findings.

Example::

    >>> print(loop_markdown({"accumulating": ["model.head"]})["Training loop"])
    - Gradients not zeroed between optimizer steps for: `model.head`
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from lightning_debug.checks.gradients import round_significant
from lightning_debug.checks.memory import PHASES as MEMORY_PHASES
from lightning_debug.checks.memory import SERIES_LABELS
from lightning_debug.checks.timing import PHASES
from lightning_debug.report.measured import step_span


def number_text(value: Any) -> str:
    """A statistic as report.md prints it: floats with 4 significant digits.

    Example::

        >>> number_text(3.14159), number_text(float("nan")), number_text(7)
        ('3.142', 'nan', '7')
    """
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _significant(summary: dict[str, Any], key: str) -> Any:
    return round_significant(summary[key], 3) if summary.get("count") else "-"


def not_judged(section: dict[str, Any]) -> list[str]:
    """One line per check the run could not judge, with why (an area's ``unavailable``).

    Example::

        >>> not_judged({"unavailable": {"learning_stalled": "the run's length is unknown"}})
        ["Not judged: `learning_stalled`: the run's length is unknown."]
    """
    return [f"Not judged: `{what}`: {why}." for what, why in (section.get("unavailable") or {}).items()]


def gradients_markdown(section: dict[str, Any]) -> dict[str, str]:
    norms = section.get("stats", {}).get("gradient_norm", {})
    lines = [f"{section['checks']} check step(s), every {section['check_frequency']} optimizer step(s)."]
    if norms.get("count"):
        lines.append(f"Global gradient norm: mean {norms['mean']:.4g}, min {norms['min']:.4g}, "
                     f"max {norms['max']:.4g}, last {norms['last']:.4g}.")
    for what, fact in (section.get("nonfinite") or {}).items():
        label = "gradients** (global norm Inf or NaN)" if what == "gradients" else f"{what}**"
        lines.append(f"**Non-finite {label} at {fact['steps']} check step(s), "
                     f"{step_span(fact)}.")
    if section.get("scaler_overflows"):
        lines.append(f"fp16 overflows the GradScaler skipped: {section['scaler_overflows']} check step(s).")
    counts = section["counts"]
    lines.append(f"Check steps with exploding gradients: {counts['exploding_checks']}, vanishing: "
                 f"{counts['vanishing_checks']}, missing: {counts['missing_checks']}, not updated: "
                 f"{counts['frozen_checks']}.")
    clip = section.get("clip_suggestion")
    if clip and clip.get("value") is not None:
        lines.append(f"Suggested clipping: `Trainer(gradient_clip_val={clip['value']:g})` ({clip['basis']}).")
    elif clip:
        lines.append(f"No clip value suggested: {clip['basis']}.")
    lines += not_judged(section)
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
    unavailable = not_judged(section)
    if unavailable:
        lines += ["", *unavailable]
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
    """A Markdown table of top-operator rows, with each one's share of the listed time.

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
    unavailable = not_judged(section)
    if unavailable:
        markdown["Not judged (performance)"] = "\n\n".join(unavailable)
    window = section.get("profiler_window") or {}
    if window.get("status") in ("skipped", "failed", "not reached"):
        markdown["torch.profiler window"] = (f"The window of `profile_steps` (steps {window['first_step']}-"
                                             f"{window['last_step']}) was {window['status']}: {window['reason']}.")
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
    """The modules flagged dead or saturated, and the last check's statistics per module (without
    ``log_activations``: only when one was flagged)."""
    flagged = section.get("flagged") or {}
    if section.get("logged") is False and not flagged:
        return {}
    lines = [f"{section.get('checks', 0)} check step(s), every {section['check_frequency']} optimizer step(s); "
             "statistics of each leaf module's output (one row per call)."]
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
            lines.append(f"| `{name}` | {stats.get('type')} | {stats.get('shape')} | {number_text(stats.get('mean'))} | "
                         f"{number_text(stats.get('std'))} | {number_text(stats.get('max_abs'))} | "
                         f"{number_text(stats.get('zero_fraction'))} | "
                         f"{'-' if saturated is None else number_text(saturated)} | "
                         f"{number_text(stats.get('nonfinite_count'))} |")
    return {"Activations": "\n".join(lines)}


def loop_markdown(section: dict[str, Any]) -> dict[str, str]:
    """Modules left in eval mode and parameters whose gradients were not zeroed; nothing when neither happened."""
    lines: list[str] = []
    for name, affected in (section.get("eval_modules") or {}).items():
        lines.append(f"- `{name or '(the whole model)'}` was in eval mode during training; affected layers: "
                     + ", ".join(f"`{layer}`" for layer in affected))
    frozen = section.get("frozen_statistics") or []
    if frozen:
        lines.append("- Normalization layers in eval mode on their own (running statistics frozen, affine parameters "
                     "trained; info): " + ", ".join(f"`{layer}`" for layer in frozen))
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
