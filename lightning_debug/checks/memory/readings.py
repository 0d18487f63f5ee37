"""Memory readings (host-side counters only: taking one never waits for the device), the robust trend through
them (a warm-up jump, an allocator's granularity or the resident set's scatter must not read as a leak), the
out-of-memory post-mortem's data and where leaked CUDA memory was allocated.

>>> read_memory(None).cpu_rss > 0, format_bytes(1536)
(True, '1.5 KB')
>>> trend = fit_trend([(step, 1000.0 + 50.0 * step) for step in range(0, 100, 10)])
>>> round(trend.slope), trend.consistency, is_steady_growth(trend, floor=100.0)
(50, 1.0, True)
"""

from __future__ import annotations

import enum
import functools
import multiprocessing
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from lightning_debug.checks.batches import named_tensors
from lightning_debug.checks.robust import MAD_TO_SIGMA, median

MB = 2**20
SERIES_LABELS = {"cuda_allocated": "CUDA memory allocated", "cpu_heap": "CPU heap in use", "cpu_rss": "process RSS",
                 "workers_rss": "DataLoader workers' RSS"}


class MemoryPhase(enum.Enum):
    """The phases of a step the monitor reads memory at and an OOM post-mortem names (values: report.json's)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    VALIDATION = "validation"


PHASES = tuple(phase.value for phase in MemoryPhase)


def format_bytes(size: float) -> str:
    """``1536 -> '1.5 KB'`` (binary units, as ``torch.cuda.memory_summary`` counts)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"  # pragma: no cover


def shape_text(shape: Sequence[int]) -> str:
    """``[2, 3]``: a shape as the messages print it."""
    return "[" + ", ".join(map(str, shape)) + "]"


def heap_in_use() -> int | None:
    """Bytes the C allocator has handed out and not taken back (``psutil.heap_info()``), or None where psutil cannot
    tell. Unlike the resident set it ignores freed-but-cached pages, so what a leak keeps alive shows byte for
    byte; 0.2-3 ms a reading."""
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


@functools.lru_cache(maxsize=1)
def _total_memory() -> int:
    return int(psutil.virtual_memory().total)


@functools.lru_cache(maxsize=4)
def _proc_files(pid: int) -> tuple[int, int] | None:
    """Descriptors of ``pid``'s ``status`` and ``/proc/meminfo``, opened once per process (None without ``/proc``)."""
    try:
        status = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    try:
        return status, os.open("/proc/meminfo", os.O_RDONLY)
    except OSError:
        os.close(status)
        return None


def _field_kb(text: bytes, name: bytes) -> int:
    at = text.index(name)
    return int(text[at + len(name):text.index(b"\n", at)].split()[0])


def _resident(status: bytes) -> tuple[int, int]:
    """The resident set and its file-backed part (bytes) of a ``/proc/<pid>/status`` text."""
    return _field_kb(status, b"VmRSS:") * 1024, _field_kb(status, b"RssFile:") * 1024


def rss_and_available() -> tuple[int, int, int]:
    """The process's resident set, its file-backed part and the memory the system can still give (bytes), as psutil
    reports them, but read on Linux through descriptors kept open (psutil opens and parses the files at every call,
    0.1 ms each). File pages (a memory-mapped data set read through an epoch) are page cache the kernel takes back,
    not memory the process holds.

    >>> rss, file_pages, available = rss_and_available()
    >>> rss > file_pages >= 0 and available > 0
    True
    """
    files = _proc_files(os.getpid())
    if files is not None:
        try:
            rss, file_pages = _resident(os.pread(files[0], 4096, 0))
            return rss, file_pages, _field_kb(os.pread(files[1], 4096, 0), b"MemAvailable:") * 1024
        except (OSError, ValueError, IndexError):  # a closed descriptor, an old kernel: reopen next time
            _proc_files.cache_clear()
    info = _process(os.getpid()).memory_info()
    return int(info.rss), 0, int(psutil.virtual_memory().available)


def workers_resident() -> tuple[int, int]:
    """The resident set without file pages, summed, of the processes this one started through ``multiprocessing``
    and that still run, and how many: the DataLoader's workers, whose memory the training process's readings do not
    show. A launcher's ranks, a logger's service or a compiler's pool are started as subprocesses, not counted. Pages
    a worker shares with the training process since the fork count in each.

    >>> resident, count = workers_resident()
    >>> count == len(multiprocessing.active_children()) and resident >= 0
    True
    """
    total = count = 0
    for worker in multiprocessing.active_children():
        try:
            with open(f"/proc/{worker.pid}/status", "rb") as handle:
                rss, file_pages = _resident(handle.read())
        except (OSError, ValueError, IndexError):
            try:
                rss, file_pages = int(psutil.Process(worker.pid).memory_info().rss), 0
            except psutil.Error:
                continue
        total += rss - file_pages
        count += 1
    return total, count


@functools.lru_cache(maxsize=16)
def cuda_total_memory(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).total_memory)


def cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device index to read (None: not an initialised CUDA device)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_peak_and_reset(index: int) -> int:
    """The allocator's peak allocated bytes since its last reset, then a reset."""
    peak = int(torch.cuda.memory_stats(index).get("allocated_bytes.all.peak", 0))
    torch.cuda.reset_peak_memory_stats(index)
    return peak


@dataclass(frozen=True)
class MemoryReading:
    """One check step's memory, in bytes. CUDA fields are None without a CUDA device; ``workers_rss`` (and
    ``workers``, how many) None where they were not read, ``cpu_rss_file`` the file pages of ``cpu_rss``."""

    cpu_rss: int
    cpu_available: int
    cpu_total: int
    cpu_heap: int | None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    cuda_total: int | None = None
    cpu_rss_file: int = 0
    workers_rss: int | None = None
    workers: int = 0

    @property
    def on_cuda(self) -> bool:
        return self.cuda_allocated is not None

    def metrics(self) -> dict[str, float]:
        """Scalars in MB under the names logged as ``debug/memory/<name>``."""
        values: dict[str, float] = {"cpu_rss_mb": self.cpu_rss / MB, "cpu_available_mb": self.cpu_available / MB}
        if self.cpu_heap is not None:
            values["cpu_heap_mb"] = self.cpu_heap / MB
        if self.workers_rss is not None:
            values["workers_rss_mb"] = self.workers_rss / MB
        if self.cuda_allocated is not None and self.cuda_reserved is not None:
            values.update(cuda_allocated_mb=self.cuda_allocated / MB, cuda_reserved_mb=self.cuda_reserved / MB,
                          cuda_fragmentation_mb=(self.cuda_reserved - self.cuda_allocated) / MB)
            if self.cuda_peak is not None:
                values["cuda_peak_mb"] = self.cuda_peak / MB
            if self.cuda_total:
                values["cuda_fraction"] = self.cuda_reserved / self.cuda_total
        return values

    def leak_series(self) -> dict[str, float]:
        """The byte counts whose trend tells a leak: exact ones first, then the noisy resident sets without their
        file pages (a memory-mapped data set read through an epoch), the training process's before its workers'."""
        series: dict[str, float] = {}
        if self.cuda_allocated is not None:
            series["cuda_allocated"] = float(self.cuda_allocated)
        if self.cpu_heap is not None:
            series["cpu_heap"] = float(self.cpu_heap)
        series["cpu_rss"] = float(self.cpu_rss - self.cpu_rss_file)
        if self.workers_rss is not None:
            series["workers_rss"] = float(self.workers_rss)
        return series


def read_memory(device: torch.device | None, reset_peak: bool = True, heap: bool = True,
                workers: bool = False) -> MemoryReading:
    """Process, system and (for a CUDA ``device``) allocator memory, never synchronising the device. ``reset_peak``:
    the next ``cuda_peak`` is the peak since this reading; ``heap``: read the C heap (:func:`heap_in_use`'s cost);
    ``workers``: read the DataLoader's workers (:func:`workers_resident`, 0.03 ms a worker)."""
    rss, file_pages, available = rss_and_available()
    host = dict(cpu_heap=heap_in_use() if heap else None, cpu_rss_file=file_pages)
    if workers:
        resident, count = workers_resident()
        host.update(workers_rss=resident if count else None, workers=count)
    total = _total_memory()
    index = cuda_index(device)
    if index is None:
        return MemoryReading(rss, available, total, **host)
    stats = torch.cuda.memory_stats(index)
    peak = int(stats.get("allocated_bytes.all.peak", 0))
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(index)
    return MemoryReading(rss, available, total, **host,
                         cuda_allocated=int(stats.get("allocated_bytes.all.current", 0)),
                         cuda_reserved=int(stats.get("reserved_bytes.all.current", 0)), cuda_peak=peak,
                         cuda_total=cuda_total_memory(index))


@dataclass(frozen=True)
class Trend:
    """A robust straight line through (step, value) readings: ``slope`` the Theil-Sen estimate (a warm-up jump
    cannot tilt it), ``noise`` the robust scatter around it, ``consistency`` Kendall's tau (1.0: always rising)."""

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
    """The :class:`Trend` of ``points`` (O(n^2): the monitor bounds the window); None below 3 distinct steps.

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


def is_steady_growth(trend: Trend | None, floor: float) -> bool:
    """Growth beyond noise: 6 readings or more, mostly rising (a tau of 0.7 over 6 readings happens by chance in
    about 3% of noise-only windows), and a rise above both ``floor`` and 4 times the scatter."""
    return (trend is not None and trend.readings >= 6 and trend.slope > 0
            and trend.consistency >= 0.7 and trend.growth >= max(floor, 4.0 * trend.noise))


def steps_until_exhausted(bytes_per_step: float, headroom: float) -> float:
    """How many more steps at ``bytes_per_step`` until ``headroom`` bytes are used (inf when not growing)."""
    return max(0.0, headroom) / bytes_per_step if bytes_per_step > 0 else float("inf")


OOM_PATTERNS = ("out of memory", "can't allocate memory", "cannot allocate memory")
OUT_OF_MEMORY: type[Exception] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
"""``torch.OutOfMemoryError`` (any accelerator), or on torch 2.2 ``torch.cuda.OutOfMemoryError``, which it aliases."""


def is_out_of_memory(error: BaseException) -> bool:
    """The allocator's error, ``MemoryError``, or a RuntimeError saying an allocation failed (CPU allocator, MPS).

    >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")), len(oom_fixes(None))
    (True, 4)
    """
    if isinstance(error, (OUT_OF_MEMORY, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    try:
        message = str(error).lower()
    except Exception:  # a user's exception whose __str__ raises is not an allocator's
        return False
    return any(pattern in message for pattern in OOM_PATTERNS)


def describe_batch(batch: Any) -> list[str]:
    """``'batch[0]: [16, 8] float32 on cpu (512 B)'`` for each of the first 20 tensors of a (nested) batch.

    >>> import torch
    >>> describe_batch({"x": torch.zeros(2, 3)})
    ["batch['x']: [2, 3] float32 on cpu (24 B)"]
    """
    return [f"{path}: {shape_text(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device} "
            f"({format_bytes(t.element_size() * t.numel())})" for path, t in named_tensors(batch)[:20]]


def oom_fixes(phase: MemoryPhase | None, fragmentation_share: float = 0.0) -> list[str]:
    """What to try after an out-of-memory error, the most specific first."""
    fixes = []
    if phase is MemoryPhase.OPTIMIZER:
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


LIBRARY_PATH_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen", "/torch/", "/lightning/",
                        "/pytorch_lightning/", "/lightning_fabric/", "/lightning_debug/")


def allocation_site(frames: Sequence[Mapping[str, Any]]) -> str:
    """``file:line in function`` of the user's line that allocated: the innermost frame outside torch, Lightning
    and the standard library, else the innermost frame.

    >>> allocation_site([{"filename": "/usr/lib/python3.12/site-packages/torch/nn.py", "line": 1, "name": "f"},
    ...                  {"filename": "/home/me/project/train.py", "line": 42, "name": "training_step"}])
    'project/train.py:42 in training_step'
    >>> allocation_site([{"filename": "/src/pytorch_lightning/loops/fit_loop.py", "line": 9, "name": "run"},
    ...                  {"filename": "/home/me/train.py", "line": 41, "name": "training_step"}])
    'me/train.py:41 in training_step'
    """
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


def cuda_leak_sites(snapshot: Mapping[str, Any], device_index: int = 0) -> list[dict[str, Any]]:
    """The 5 allocation sites with the most bytes alive in a ``torch.cuda.memory._snapshot()`` trace (an allocation
    no free follows), among those with 2 or more alive and at least half of their allocations alive: a site that
    allocates and frees every step (activations, gradients) has few alive, a leak keeps most."""
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
    count = Counter(site for site, _ in alive.values())
    size: Counter[str] = Counter()
    for site, nbytes in alive.values():
        size[site] += nbytes
    sites = [{"site": site, "alive": count[site], "alive_mb": size[site] / MB, "allocations": allocations[site]}
             for site in count if count[site] >= 2 and 2 * count[site] >= allocations[site]]
    return sorted(sites, key=lambda site: -site["alive_mb"])[:5]
