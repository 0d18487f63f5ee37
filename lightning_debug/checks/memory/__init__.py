"""Memory readings and the pure analyses behind :class:`~lightning_debug.MemoryProfilerCallback`.

No framework here. The readings (:mod:`.readings`) are host-side counters only: the process's
resident set (psutil), the bytes the C allocator has handed out (``psutil.heap_info``) and the CUDA
caching allocator's own statistics, so reading them never waits for the GPU. A robust trend through
them (:mod:`.trend`) tells steady growth from noise. The expensive parts, a census of live tensors
through :mod:`gc` (:mod:`.census`) and the analysis of a CUDA memory snapshot (:mod:`.snapshot`),
are separate functions that the monitor calls only to confirm a suspected leak or after an
out-of-memory error (:mod:`.oom`).

Example::

    >>> import torch
    >>> from lightning_debug.checks.memory import fit_trend, is_steady_growth, read_memory
    >>> read_memory(None).cpu_rss > 0
    True
    >>> trend = fit_trend([(step, 1000.0 + 50.0 * step) for step in range(0, 100, 10)])
    >>> round(trend.slope), trend.consistency, is_steady_growth(trend, floor=100.0)
    (50, 1.0, True)
"""

from __future__ import annotations

from lightning_debug.checks.memory.census import (
    GRAPHS_MEASURED_PER_GROUP,
    STEADY_PER_STEP,
    Census,
    CensusKey,
    GraphGrowth,
    GroupGrowth,
    census_growth,
    explain_growth,
    graph_growth,
    graph_size,
    growth_rank,
    live_tensors,
    take_census,
)
from lightning_debug.checks.memory.oom import OOM_PATTERNS, describe_batch, is_out_of_memory, oom_fixes
from lightning_debug.checks.memory.readings import (
    MB,
    PHASES,
    SERIES_LABELS,
    MemoryPhase,
    MemoryReading,
    cuda_index,
    cuda_peak_and_reset,
    cuda_total_memory,
    format_bytes,
    heap_in_use,
    read_memory,
    shape_text,
)
from lightning_debug.checks.memory.snapshot import LIBRARY_PATH_MARKERS, allocation_site, cuda_leak_sites
from lightning_debug.checks.memory.trend import Trend, fit_trend, is_steady_growth, steps_until_exhausted

__all__ = [
    "GRAPHS_MEASURED_PER_GROUP", "LIBRARY_PATH_MARKERS", "MB", "OOM_PATTERNS", "PHASES", "SERIES_LABELS",
    "STEADY_PER_STEP", "Census", "CensusKey", "GraphGrowth", "GroupGrowth", "MemoryPhase", "MemoryReading", "Trend",
    "allocation_site", "census_growth", "cuda_index", "cuda_leak_sites", "cuda_peak_and_reset",
    "cuda_total_memory", "describe_batch", "explain_growth", "fit_trend", "format_bytes", "graph_growth",
    "graph_size", "growth_rank", "heap_in_use", "is_out_of_memory", "is_steady_growth", "live_tensors",
    "oom_fixes", "read_memory", "shape_text", "steps_until_exhausted", "take_census",
]
