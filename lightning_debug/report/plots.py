"""``debug_analysis.png``: the loss, step time, memory, gradient norm and findings over the steps of one run.

The loss comes first: it is the curve a person debugging a NaN or a divergence looks at. matplotlib is an optional
extra, imported only when a figure is drawn, through the Agg API, so a user's own pyplot backend is untouched.

Example::

    >>> import tempfile, pathlib
    >>> from lightning_debug.core.timeline import Timeline
    >>> from lightning_debug.report.plots import draw_debug_analysis
    >>> timeline = Timeline()
    >>> for step in range(20):
    ...     timeline.observe_metrics({"debug/perf/step_ms": 10.0 + step % 3, "debug/grad/global_norm": 1.0}, step)
    >>> path = draw_debug_analysis(timeline, pathlib.Path(tempfile.mkdtemp()) / "debug_analysis.png")
    >>> path.read_bytes()[:4] == b"\\x89PNG"
    True
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from lightning_debug.core.kinds import severity_rank
from lightning_debug.core.timeline import LOSS_SERIES, Timeline
from lightning_debug.report.document import write_atomic

PLOT_FILENAME = "debug_analysis.png"
INSTALL_HINT = "pip install matplotlib"  # works wherever the package came from: the ``plots`` extra is only that
SEVERITY_COLORS = {"critical": "#7b0000", "error": "#d62728", "warning": "#ff7f0e", "info": "#8c8c8c"}
MAX_MARKED_STEPS = 8


class PlotsUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(f"debug_analysis.png needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def _nothing(axis: Any, text: str) -> None:
    axis.set_yticks([])
    axis.text(0.5, 0.5, text, transform=axis.transAxes, ha="center", va="center", color="#777777", fontsize=9)


def _lines(axis: Any, timeline: Timeline, curves: list[tuple[str, str]], changes: bool = False) -> bool:
    """Draw each curve that has points; with ``changes``, as its change since its first reading (MB)."""
    drawn = False
    for tag, label in curves:
        steps, values = timeline.values(tag)
        if steps:
            if changes:
                start = values[0]
                values, label = [value - start for value in values], f"{label} (from {start:,.0f} MB)"
            axis.plot(steps, values, label=label, linewidth=1.2, marker="." if len(steps) < 60 else None)
            drawn = True
    if drawn:
        if changes:
            axis.axhline(0, color="#bbbbbb", linewidth=0.8)
        axis.legend(loc="upper left", fontsize=8, frameon=False)
        axis.grid(alpha=0.3)
    return drawn


def plain(text: str) -> str:
    """``text`` drawn as it is: a ``$`` would start matplotlib's mathtext, and an odd one fails the whole figure.

    Example::

        >>> plain("cost$x$_{a}")
        'cost\\\\$x\\\\$_{a}'
    """
    return text.replace("$", r"\$")


def _findings_panel(axis: Any, timeline: Timeline, last_step: int, steps_by_kind: dict[str, int]) -> bool:
    by_kind: dict[str, str] = {}
    for episode in timeline.episodes:
        current = by_kind.get(episode.kind)
        if current is None or severity_rank(episode.severity) < severity_rank(current):
            by_kind[episode.kind] = episode.severity
    if not by_kind:
        return False
    kinds = sorted(by_kind, key=lambda kind: (severity_rank(by_kind[kind]), kind), reverse=True)
    rows = {kind: row for row, kind in enumerate(kinds)}
    for episode in timeline.episodes:
        row = rows[episode.kind]
        color = SEVERITY_COLORS.get(episode.severity, "#1f77b4")
        end = episode.last_step if episode.last_step is not None else max(last_step, episode.first_step)
        still_open = episode.last_step is None and steps_by_kind.get(episode.kind, 2) > 1  # a one-off has no end
        if still_open or (episode.check_steps > 1 and end > episode.first_step):
            axis.broken_barh([(episode.first_step - 0.4, end - episode.first_step + 0.8)], (row - 0.3, 0.6),
                             facecolors=color, alpha=0.45, hatch="//" if still_open else None)
        axis.plot([episode.first_step], [row], marker="v", color=color, markersize=7)
    axis.set_yticks(range(len(kinds)), [plain(f"{kind} ({by_kind[kind]})") for kind in kinds], fontsize=8)
    axis.set_ylim(-0.7, len(kinds) - 0.3)
    axis.grid(axis="x", alpha=0.3)
    return True


def _loss(axis: Any, timeline: Timeline) -> bool:
    steps, values = timeline.values(LOSS_SERIES)
    if not steps:
        return False
    axis.plot(steps, values, label=timeline.loss_source or "loss", linewidth=1.2, color="#222222",
              marker="." if len(steps) < 60 else None)
    positive = [value for value in values if value > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 100:
        axis.set_yscale("log")
    axis.legend(loc="upper right", fontsize=8, frameon=False)
    axis.grid(alpha=0.3)
    return True


def draw_debug_analysis(timeline: Timeline, path: Path, *, title: str = "lightning-debug",
                        explosion_threshold: float | None = None, steps_by_kind: dict[str, int] | None = None) -> Path:
    """Draw the five panels into ``path`` (PNG); raises :class:`PlotsUnavailable` without matplotlib."""
    figure_type, canvas_type = _matplotlib()
    figure = figure_type(figsize=(11, 12), dpi=100, layout="constrained")
    canvas_type(figure)
    loss_axis, step_axis, memory_axis, grad_axis, findings_axis = figure.subplots(
        5, 1, sharex=True, height_ratios=[1.2, 1, 1, 1, 1.1])
    figure.suptitle(plain(title), fontsize=12)
    last_step = max(timeline.last_step, 0)

    loss_axis.set_title("Loss (gaps: steps where it was NaN/Inf)", loc="left", fontsize=10)
    if not _loss(loss_axis, timeline):
        _nothing(loss_axis, "no loss: add AnomalyDetectionCallback (it reads the loss on its check steps)")

    step_axis.set_title("Step time", loc="left", fontsize=10)
    step_axis.set_ylabel("ms")
    if not _lines(step_axis, timeline, [("debug/perf/step_ms", "step"), ("debug/perf/data_ms", "data wait")]):
        _nothing(step_axis, "no step times: add PerformanceProfilerCallback (log_performance: true)")

    memory_axis.set_title("Memory: change since the first reading", loc="left", fontsize=10)
    memory_axis.set_ylabel("MB")
    memory = [("debug/memory/cpu_rss_mb", "process RSS"), ("debug/memory/cpu_heap_mb", "C heap in use"),
              ("debug/memory/workers_rss_mb", "DataLoader workers' RSS"),
              ("debug/memory/cuda_allocated_mb", "CUDA allocated"), ("debug/memory/cuda_reserved_mb", "CUDA reserved")]
    if not _lines(memory_axis, timeline, memory, changes=True):
        _nothing(memory_axis, "no memory readings: add MemoryProfilerCallback (log_memory: true)")

    grad_axis.set_title("Global gradient norm", loc="left", fontsize=10)
    curves = [("debug/grad/global_norm", "global norm")] + [
        (tag, f"optimizer {tag.rsplit('_', 1)[-1]}") for tag in timeline.optimizer_norms()]
    if _lines(grad_axis, timeline, curves):
        norms = [value for tag, _ in curves for value in timeline.values(tag)[1]]
        positive = [value for value in norms if value > 0]
        if positive and max(positive) / min(positive) > 100:
            grad_axis.set_yscale("log")
        threshold = explosion_threshold
        if threshold and positive and threshold / 100 <= max(positive) and threshold * 100 >= min(positive):
            grad_axis.axhline(threshold, color="#999999", linestyle=":", linewidth=1)
            grad_axis.annotate("gradient_explosion_threshold", (0, threshold), xycoords=("axes fraction", "data"),
                               fontsize=7, color="#666666", va="bottom")
    else:
        _nothing(grad_axis, "no gradient norms: add GradientHealthCallback")

    findings_axis.set_title("Findings (marker: where it started; bar: an episode over several check steps, "
                            "hatched while still open)", loc="left", fontsize=10)
    findings_axis.set_xlabel("optimizer step")
    if not _findings_panel(findings_axis, timeline, last_step, steps_by_kind or {}):
        findings_axis.set_yticks([])
        _nothing(findings_axis, "no findings")

    serious = sorted({e.first_step for e in timeline.episodes if severity_rank(e.severity) <= 1})
    for step in serious[:MAX_MARKED_STEPS]:
        for axis in (loss_axis, step_axis, memory_axis, grad_axis):
            axis.axvline(step, color=SEVERITY_COLORS["error"], linestyle="--", linewidth=0.8, alpha=0.6)
    findings_axis.set_xlim(-0.5, max(last_step, 1) + 0.5)
    image = io.BytesIO()
    figure.savefig(image, format="png")
    return write_atomic(path, image.getvalue())


def write_debug_analysis(directory: Path, timeline: Timeline, report: dict[str, Any]) -> Path:
    """``directory/debug_analysis.png`` for ``report``'s run, titled with its status and findings."""
    config = report.get("config") or {}
    findings = report.get("findings") or {}
    serious = [kind for kind, entry in findings.items()
               if isinstance(entry, dict) and severity_rank(entry.get("severity")) <= severity_rank("warning")]
    title = (f"lightning-debug: {report.get('status', '?')} at step {report.get('last_step', '?')}\n"
             + (f"{len(serious)} kind(s) of finding of severity warning or above: " + ", ".join(serious[:5])
                + (" ..." if len(serious) > 5 else "") if serious else "nothing of severity warning or above"))
    steps = {kind: int(entry.get("steps") or 1) for kind, entry in findings.items() if isinstance(entry, dict)}
    return draw_debug_analysis(timeline, directory / PLOT_FILENAME, title=title,
                               explosion_threshold=config.get("gradient_explosion_threshold"), steps_by_kind=steps)
