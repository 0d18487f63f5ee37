"""Memory readings and the pure analyses behind :class:`~lightning_debug.MemoryProfilerCallback`.

No framework here. The readings are host-side counters only: the process's resident set (psutil),
the bytes the C allocator has handed out (``psutil.heap_info``) and the CUDA caching allocator's own
statistics, so reading them never waits for the GPU. The expensive parts, a census of live tensors
through :mod:`gc` and the analysis of a CUDA memory snapshot, are separate functions that the
monitor calls only to confirm a suspected leak or after an out-of-memory error.

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

import functools
import gc
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import psutil
import torch

from lightning_debug.checks.robust import MAD_TO_SIGMA, median

MB = 2**20
CensusKey = tuple[tuple[int, ...], str, str, str]  # shape, dtype, device, grad_fn class name ("" for none)
LIBRARY_PATH_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen", "/torch/", "/lightning/",
                        "/lightning_fabric/", "/lightning_debug/")
GRAPHS_MEASURED_PER_GROUP = 8
STEADY_PER_STEP = 0.5  # a group growing by at least a tensor every two steps grows with the steps
OOM_PATTERNS = ("out of memory", "can't allocate memory", "cannot allocate memory")
SERIES_LABELS = {"cuda_allocated": "CUDA memory allocated", "cpu_heap": "CPU heap in use", "cpu_rss": "process RSS"}
PHASES = ("forward", "backward", "optimizer", "validation")


def format_bytes(size: float) -> str:
    """``1536 -> '1.5 KB'`` (binary units, as ``torch.cuda.memory_summary`` counts)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"  # pragma: no cover


# --- readings -----------------------------------------------------------------------------------------


def heap_in_use() -> int | None:
    """Bytes the C allocator has handed out and not taken back, or None where psutil cannot tell.

    ``psutil.heap_info()``: on Linux (glibc) the bytes of chunks in use in every arena plus mmapped
    chunks (``mallinfo2``'s ``uordblks + hblkhd``), on macOS and Windows the platform allocator's
    equivalent. Unlike the resident set it ignores freed-but-cached pages, so the CPU tensors and
    autograd nodes a leak keeps alive show up byte for byte. Costs about a microsecond (a few
    milliseconds on a heavily fragmented heap, when glibc walks its free lists).
    """
    read = getattr(psutil, "heap_info", None)
    if read is None:
        return None
    try:
        info = read()
    except (OSError, NotImplementedError, RuntimeError):
        return None
    return int(info.heap_used + info.mmap_used)


@functools.lru_cache(maxsize=4)
def _process(pid: int) -> psutil.Process:
    return psutil.Process(pid)


@functools.lru_cache(maxsize=16)
def cuda_total_memory(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).total_memory)


def cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device index to read, or None when ``device`` is not an initialised CUDA device."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_peak_and_reset(index: int) -> int:
    """The allocator's peak allocated bytes since its last reset, then a reset (host-side counters)."""
    peak = int(torch.cuda.memory_stats(index).get("allocated_bytes.all.peak", 0))
    torch.cuda.reset_peak_memory_stats(index)
    return peak


@dataclass(frozen=True)
class MemoryReading:
    """One check step's memory, in bytes. CUDA fields are None without a CUDA device."""

    cpu_rss: int
    cpu_available: int
    cpu_total: int
    cpu_heap: int | None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    cuda_total: int | None = None

    @property
    def on_cuda(self) -> bool:
        return self.cuda_allocated is not None

    def metrics(self) -> dict[str, float]:
        """Scalars in MB under the names logged as ``debug/memory/<name>``."""
        values: dict[str, float] = {"cpu_rss_mb": self.cpu_rss / MB, "cpu_available_mb": self.cpu_available / MB}
        if self.cpu_heap is not None:
            values["cpu_heap_mb"] = self.cpu_heap / MB
        if self.cuda_allocated is not None and self.cuda_reserved is not None:
            values.update(cuda_allocated_mb=self.cuda_allocated / MB, cuda_reserved_mb=self.cuda_reserved / MB,
                          cuda_fragmentation_mb=(self.cuda_reserved - self.cuda_allocated) / MB)
            if self.cuda_peak is not None:
                values["cuda_peak_mb"] = self.cuda_peak / MB
            if self.cuda_total:
                values["cuda_fraction"] = self.cuda_reserved / self.cuda_total
        return values

    def leak_series(self) -> dict[str, float]:
        """The byte counts whose trend tells a leak: exact ones first, the noisy resident set last."""
        series: dict[str, float] = {}
        if self.cuda_allocated is not None:
            series["cuda_allocated"] = float(self.cuda_allocated)
        if self.cpu_heap is not None:
            series["cpu_heap"] = float(self.cpu_heap)
        series["cpu_rss"] = float(self.cpu_rss)
        return series


def read_memory(device: torch.device | None, reset_peak: bool = True) -> MemoryReading:
    """Process, system and (for a CUDA ``device``) allocator memory; never synchronises the device.

    With ``reset_peak`` the CUDA peak counter restarts, so the next reading's ``cuda_peak`` is the
    peak since this one.
    """
    rss = _process(os.getpid()).memory_info().rss
    system = psutil.virtual_memory()
    index = cuda_index(device)
    if index is None:
        return MemoryReading(rss, int(system.available), int(system.total), heap_in_use())
    stats = torch.cuda.memory_stats(index)
    peak = int(stats.get("allocated_bytes.all.peak", 0))
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(index)
    return MemoryReading(rss, int(system.available), int(system.total), heap_in_use(),
                         cuda_allocated=int(stats.get("allocated_bytes.all.current", 0)),
                         cuda_reserved=int(stats.get("reserved_bytes.all.current", 0)), cuda_peak=peak,
                         cuda_total=cuda_total_memory(index))


# --- trend ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trend:
    """A robust straight line through (step, value) readings.

    ``slope`` is the Theil-Sen estimate (median of the pairwise slopes, so a warm-up jump or an odd
    reading cannot tilt it), ``noise`` the robust scatter around the line (1.4826 x MAD of the
    residuals) and ``consistency`` Kendall's tau of value against step: 1.0 when every later reading
    is higher than every earlier one, about 0 for noise.
    """

    slope: float
    intercept: float
    noise: float
    consistency: float
    readings: int
    first_step: int
    last_step: int

    @property
    def growth(self) -> float:
        """What the line rises over the readings' span."""
        return self.slope * (self.last_step - self.first_step)

    def summary(self, unit: float = MB) -> dict[str, Any]:
        return {"per_step": self.slope / unit, "growth": self.growth / unit, "noise": self.noise / unit,
                "consistency": round(self.consistency, 3), "readings": self.readings,
                "first_step": self.first_step, "last_step": self.last_step}


def fit_trend(points: Sequence[tuple[int, float]]) -> Trend | None:
    """Theil-Sen slope, residual scatter and Kendall's tau of ``points``; None below 3 distinct steps.

    O(n^2) in the number of readings, which the monitor bounds (a window of a few dozen).

    Example::

        >>> trend = fit_trend([(0, 5.0), (10, 5.0), (20, 9.0), (30, 5.0), (40, 5.0)])
        >>> trend.slope, trend.consistency
        (0.0, 0.0)
    """
    if len({step for step, _ in points}) < 3:
        return None
    slopes: list[float] = []
    concordance = 0
    pairs = 0
    for i, (step_i, value_i) in enumerate(points):
        for step_j, value_j in points[i + 1:]:
            if step_j == step_i:
                continue
            slopes.append((value_j - value_i) / (step_j - step_i))
            direction = (value_j > value_i) - (value_j < value_i)
            concordance += direction if step_j > step_i else -direction
            pairs += 1
    slope = median(slopes)
    intercept = median(value - slope * step for step, value in points)
    residuals = [abs(value - intercept - slope * step) for step, value in points]
    steps = [step for step, _ in points]
    return Trend(slope=slope, intercept=intercept, noise=MAD_TO_SIGMA * median(residuals),
                 consistency=concordance / pairs, readings=len(points), first_step=min(steps),
                 last_step=max(steps))


def is_steady_growth(trend: Trend | None, floor: float, min_readings: int = 6, min_consistency: float = 0.7,
                     noise_factor: float = 4.0) -> bool:
    """Growth beyond noise: enough readings, mostly rising (Kendall's tau), and a rise over the window
    above both ``floor`` (allocator granularity, warm-up creep) and ``noise_factor`` times the scatter.

    With 6 readings a tau of 0.7 happens by chance in about 3% of noise-only windows; the floor and
    the noise test must hold as well.
    """
    return (trend is not None and trend.readings >= min_readings and trend.slope > 0
            and trend.consistency >= min_consistency and trend.growth >= max(floor, noise_factor * trend.noise))


def steps_until_exhausted(bytes_per_step: float, headroom: float) -> float:
    """How many more steps at ``bytes_per_step`` until ``headroom`` bytes are used (inf when not growing)."""
    if bytes_per_step <= 0:
        return float("inf")
    return max(0.0, headroom) / bytes_per_step


# --- census of live tensors -----------------------------------------------------------------------------


def _tensor_types() -> set[type]:
    found: set[type] = set()
    pending = [torch.Tensor]
    while pending:
        kind = pending.pop()
        if kind not in found:
            found.add(kind)
            pending.extend(kind.__subclasses__())
    return found


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the Python garbage collector tracks (tensors held only inside C++, such as the
    activations an autograd graph saved, have no Python object and are not included).

    One pass over all gc-tracked objects in C (no per-object Python code); drop the list soon.
    """
    objects = gc.get_objects()
    kinds = _tensor_types()
    try:
        return list(compress(objects, map(kinds.__contains__, map(type, objects))))
    finally:
        del objects


def graph_size(grad_fn: Any, limit: int = 100_000) -> int:
    """Number of autograd nodes reachable from ``grad_fn``: what one kept output keeps alive."""
    seen = {grad_fn}
    pending = [grad_fn]
    while pending and len(seen) < limit:
        node = pending.pop()
        for following, _ in getattr(node, "next_functions", ()):
            if following is not None and following not in seen:
                seen.add(following)
                pending.append(following)
    return len(seen)


@dataclass
class Census:
    """Live tensors grouped by (shape, dtype, device, grad_fn): count and bytes per group.

    ``graph_nodes`` holds, for groups whose tensors carry a ``grad_fn``, the largest autograd graph
    among their first few members; ``seconds`` what taking the census cost.
    """

    groups: dict[CensusKey, list[int]] = field(default_factory=dict)
    graph_nodes: dict[CensusKey, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tensors(self) -> int:
        return sum(count for count, _ in self.groups.values())

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.groups.values())

    def largest(self, limit: int = 10) -> list[dict[str, Any]]:
        """The groups holding the most bytes, largest first."""
        ordered = sorted(self.groups.items(), key=lambda item: -item[1][1])[:limit]
        return [dict(_describe_key(key), count=count, mb=size / MB) for key, (count, size) in ordered]


def _describe_key(key: CensusKey) -> dict[str, Any]:
    shape, dtype, device, grad_fn = key
    return {"shape": list(shape), "dtype": dtype, "device": device, "grad_fn": grad_fn or None}


def take_census(tensors: Sequence[torch.Tensor] | None = None) -> Census:
    """Group ``tensors`` (by default every live tensor, see :func:`live_tensors`) for a census.

    Reads only metadata (shape, dtype, device, ``grad_fn``): no device sync, no data access.
    """
    started = time.perf_counter()
    census = Census()
    items = live_tensors() if tensors is None else tensors
    try:
        for tensor in items:
            try:
                grad_fn = tensor.grad_fn
                key: CensusKey = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), str(tensor.device),
                                  type(grad_fn).__name__ if grad_fn is not None else "")
                size = tensor.element_size() * tensor.numel()
            except Exception:  # exotic subclasses (nested, fake, functional) may refuse metadata calls
                continue
            entry = census.groups.get(key)
            if entry is None:
                entry = census.groups[key] = [0, 0]
            entry[0] += 1
            entry[1] += size
            if grad_fn is not None and entry[0] <= GRAPHS_MEASURED_PER_GROUP:
                census.graph_nodes[key] = max(census.graph_nodes.get(key, 0), graph_size(grad_fn))
    finally:
        del items
    census.seconds = time.perf_counter() - started
    return census


@dataclass(frozen=True)
class GroupGrowth:
    """A census group that gained tensors between two censuses ``steps`` apart."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    grad_fn: str
    added: int
    added_bytes: int
    per_step: float
    graph_nodes: int

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device,
                "grad_fn": self.grad_fn or None, "added": self.added, "added_mb": self.added_bytes / MB,
                "per_step": round(self.per_step, 3), "graph_nodes": self.graph_nodes}


def growth_rank(group: GroupGrowth) -> tuple[bool, bool, int, int]:
    """Sort key, most likely cause first: steadily growing groups that hold an autograd graph (a kept
    graph keeps its saved tensors alive, so the graph-less groups growing beside it are its
    consequence), then steady growth by bytes, then the rest by bytes."""
    steady = group.added >= 2 and group.per_step >= STEADY_PER_STEP
    return (not (steady and bool(group.grad_fn)), not steady, -group.added_bytes, -group.added)


def census_growth(before: Census, after: Census, steps: int) -> list[GroupGrowth]:
    """Groups with more tensors in ``after`` than in ``before``, most likely cause first (:func:`growth_rank`).

    Example: the loss kept with its graph leads, although the batch targets its graph saved are
    more tensors and more bytes::

        >>> import torch
        >>> weight = torch.ones(3, requires_grad=True)
        >>> before = take_census([weight])
        >>> kept = [(weight * torch.ones(32, 3)).sum() for _ in range(10)] + [torch.ones(32) for _ in range(20)]
        >>> [(g.grad_fn, g.added) for g in census_growth(before, take_census([weight, *kept]), 10)]
        [('SumBackward0', 10), ('', 20)]
    """
    grown = []
    for key, (count, size) in after.groups.items():
        old_count, old_size = before.groups.get(key, (0, 0))
        if count > old_count:
            shape, dtype, device, grad_fn = key
            grown.append(GroupGrowth(shape, dtype, device, grad_fn, count - old_count, size - old_size,
                                     (count - old_count) / max(steps, 1), after.graph_nodes.get(key, 0)))
    return sorted(grown, key=growth_rank)


@dataclass(frozen=True)
class GraphGrowth:
    """A census group whose representative's autograd graph grew between two censuses (a running total)."""

    shape: tuple[int, ...]
    grad_fn: str
    nodes_before: int
    nodes_after: int

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "grad_fn": self.grad_fn, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after}


def graph_growth(before: Census, after: Census, steps: int) -> list[GraphGrowth]:
    """Groups whose autograd graph gained at least one node per step: ``total = total + loss`` keeps
    every step's graph while the number of tensors stays the same."""
    grown = []
    for key, nodes in after.graph_nodes.items():
        old = before.graph_nodes.get(key)
        if old is not None and nodes - old >= max(steps, 2):
            grown.append(GraphGrowth(key[0], key[3], old, nodes))
    return sorted(grown, key=lambda graph: graph.nodes_before - graph.nodes_after)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def explain_growth(grown: Sequence[GroupGrowth], steps: int, graphs: Sequence[GraphGrowth] = ()) -> str:
    """The cause sentence of a ``memory_growth`` event, from a census diff over ``steps`` steps
    (tensors that pile up, and graphs that grow, see :func:`graph_growth`).

    Example::

        >>> group = GroupGrowth((), "float32", "cpu", "NllLossBackward0", 50, 200, 1.0, 9)
        >>> explain_growth([group], 50)[:71]
        '~1 tensor/step with grad_fn NllLossBackward0 (shape [], float32 on cpu)'
    """
    growing = [group for group in grown if group.added >= 2]
    running = ""
    if graphs:
        graph = graphs[0]
        running = (f"A tensor {_shape_text(graph.shape)} with grad_fn {graph.grad_fn} carries an autograd graph that "
                   f"grew from {graph.nodes_before} to {graph.nodes_after} nodes in {steps} steps: a running total "
                   "keeps every step's graph (e.g. self.total_loss += loss); accumulate loss.item() or loss.detach() "
                   "instead.")
        if not growing:
            return running
        running = " " + running
    if not growing:
        return (f"No group of live tensors grew over the last {steps} steps, so the growth is outside tensors "
                "reachable from Python: Python objects kept per step (lists, dicts, caches), memory held by C "
                "extensions, or tensors kept only inside C++. Trace it with tracemalloc or, on CUDA, "
                "torch.cuda.memory._record_memory_history.")
    top = growing[0]
    plural = top.per_step >= 1.5
    rate = f"~{top.per_step:.2g} tensor{'s' if plural else ''}/step"
    verb = "stay" if plural else "stays"
    what = f"(shape {_shape_text(top.shape)}, {top.dtype} on {top.device})"
    others = ""
    if len(growing) > 1:
        held = top.grad_fn and any(not group.grad_fn for group in growing[1:4])
        others = (" Also growing (tensors these graphs saved for backward stay alive with them):" if held else
                  " Also growing:") + " " + "; ".join(
            f"~{group.per_step:.2g}/step {_shape_text(group.shape)} {group.dtype}"
            + (f" {group.grad_fn}" if group.grad_fn else "") for group in growing[1:4]) + "."
    if top.grad_fn:
        graph = f", each keeping an autograd graph of {top.graph_nodes} nodes alive" if top.graph_nodes > 1 else ""
        if not top.shape:
            cause = ("scalars with a graph are losses or metrics, so a list keeps losses with their graphs (e.g. "
                     "self.history.append(loss)); store loss.detach() or loss.item() instead")
        else:
            cause = ("something (a list, a dict, a cache, a running total) keeps tensors that still carry their "
                     "autograd graph; store t.detach() (or t.item() / t.detach().cpu()) instead")
        return f"{rate} with grad_fn {top.grad_fn} {what} {verb} alive{graph}: {cause}.{others}{running}"
    return (f"{rate} {what} without a graph {verb} alive: something keeps a tensor per step (a list of outputs, "
            f"metrics or batches, a cache); keep a bounded window or Python numbers (t.item()), or detach() and "
            f"move them to the CPU if they must be kept.{others}{running}")


# --- CUDA snapshot ---------------------------------------------------------------------------------------


def allocation_site(frames: Sequence[Mapping[str, Any]]) -> str:
    """``file:line in function`` of the innermost frame outside torch, Lightning and the standard
    library (the user's line that allocated), else of the innermost frame."""
    chosen = None
    for frame in frames:
        filename = str(frame.get("filename", "")).replace("\\", "/")
        if filename and not any(marker in filename for marker in LIBRARY_PATH_MARKERS):
            chosen = frame
            break
    chosen = chosen or (frames[0] if frames else None)
    if chosen is None:
        return "unknown (no stack recorded)"
    parts = str(chosen.get("filename", "?")).replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{chosen.get('line', '?')} in {chosen.get('name', '?')}"


def cuda_leak_sites(snapshot: Mapping[str, Any], device_index: int = 0, min_alive: int = 2,
                    limit: int = 5) -> list[dict[str, Any]]:
    """Allocation sites whose allocations stay alive, from a ``torch.cuda.memory._snapshot()`` taken
    while ``_record_memory_history`` was on.

    The trace is replayed: an allocation is alive when no free follows it. A site that allocates
    every step and frees it again (activations, gradients) has few of its allocations alive; a leak
    keeps most of them, so sites with at least ``min_alive`` live allocations and at least half of
    their recorded allocations alive are returned, most bytes first.
    """
    traces = snapshot.get("device_traces") or []
    if device_index >= len(traces):
        return []
    alive: dict[int, tuple[str, int]] = {}
    allocations: Counter[str] = Counter()
    for entry in traces[device_index]:
        action = entry.get("action")
        if action == "alloc":
            site = allocation_site(entry.get("frames") or [])
            alive[entry["addr"]] = (site, int(entry.get("size", 0)))
            allocations[site] += 1
        elif action in ("free_requested", "free_completed"):
            alive.pop(entry.get("addr"), None)
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for site, nbytes in alive.values():
        count[site] += 1
        size[site] += nbytes
    sites = [{"site": site, "alive": count[site], "alive_mb": size[site] / MB, "allocations": allocations[site]}
             for site in count if count[site] >= min_alive and 2 * count[site] >= allocations[site]]
    return sorted(sites, key=lambda site: -site["alive_mb"])[:limit]


# --- out of memory ---------------------------------------------------------------------------------------


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA and other accelerators), Python's ``MemoryError``, or a
    RuntimeError whose message says an allocation failed (CPU allocator, MPS)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(pattern in str(error).lower() for pattern in OOM_PATTERNS)


def describe_batch(batch: Any, limit: int = 20) -> list[str]:
    """``'batch[0]: [16, 8] float32 on cpu (512 B)'`` for each tensor in a (nested) batch.

    Example::

        >>> import torch
        >>> describe_batch({"x": torch.zeros(2, 3)})
        ["batch['x']: [2, 3] float32 on cpu (24 B)"]
    """
    lines: list[str] = []

    def visit(value: Any, path: str, depth: int) -> None:
        if len(lines) >= limit or depth > 6:
            return
        if isinstance(value, torch.Tensor):
            lines.append(f"{path}: {_shape_text(value.shape)} {str(value.dtype).removeprefix('torch.')} on "
                         f"{value.device} ({format_bytes(value.element_size() * value.numel())})")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for position, item in enumerate(value):
                visit(item, f"{path}[{position}]", depth + 1)

    visit(batch, "batch", 0)
    return lines


def oom_fixes(phase: str | None, fragmentation_share: float = 0.0) -> list[str]:
    """What to try after an out-of-memory error, the most specific first."""
    fixes = []
    if phase == "optimizer":
        fixes.append("The optimizer step ran out: its state (Adam keeps two copies of every parameter) does "
                     "not fit. Shard it (FSDP / DeepSpeed ZeRO), use a lighter optimizer (SGD, 8-bit Adam), "
                     "or train fewer parameters.")
    if fragmentation_share > 0.1:
        fixes.append("Much memory is reserved but not allocated (fragmentation): set "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    fixes += [
        "Smaller batch: lower batch_size (a half roughly halves the activations).",
        "Gradient accumulation: keep the effective batch with Trainer(accumulate_grad_batches=k) and a batch "
        "k times smaller.",
        "Mixed precision: Trainer(precision='bf16-mixed') (or '16-mixed') halves activation memory.",
        "Activation checkpointing: torch.utils.checkpoint (or FSDP activation_checkpointing_policy) recomputes "
        "activations in backward instead of keeping them.",
    ]
    return fixes
