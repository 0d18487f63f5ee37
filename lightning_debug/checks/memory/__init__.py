"""Memory readings and the pure analyses behind :class:`~lightning_debug.MemoryProfilerCallback`: the cheap
host-side readings (:mod:`.readings`) and the census of live tensors that confirms a suspected leak (:mod:`.census`).
"""

from __future__ import annotations

from lightning_debug.checks.memory.census import (Census, GraphGrowth, GroupGrowth, census_growth, explain_growth,
                                                  graph_growth, take_census)
from lightning_debug.checks.memory.readings import (MB, PHASES, SERIES_LABELS, MemoryPhase, MemoryReading, Trend,
                                                    allocation_site, cuda_index, cuda_leak_sites, cuda_peak_and_reset,
                                                    describe_batch, fit_trend, format_bytes, heap_in_use,
                                                    is_out_of_memory, is_steady_growth, oom_fixes, read_memory,
                                                    steps_until_exhausted)

__all__ = [
    "MB", "PHASES", "SERIES_LABELS", "Census", "GraphGrowth", "GroupGrowth", "MemoryPhase", "MemoryReading", "Trend",
    "allocation_site", "census_growth", "cuda_index", "cuda_leak_sites", "cuda_peak_and_reset", "describe_batch",
    "explain_growth", "fit_trend", "format_bytes", "graph_growth", "heap_in_use", "is_out_of_memory",
    "is_steady_growth", "oom_fixes", "read_memory", "steps_until_exhausted", "take_census",
]
