"""The torch.profiler window and the sync-debug window over a few steps, and what they found.

Both change global state, so :meth:`StepWindows.restore` undoes them whatever happened. torch allows one profiler
per thread: where another one records, the window is skipped, and a profiler whose ``start()`` failed is never
touched again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import linecache
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_debug.checks.timing import top_operators
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.performance.settings import PerformanceSettings

TOP_OPERATORS = 15
MAX_SYNC_SITES = 10
PACKAGE_DIR = str(Path(__file__).resolve().parents[2])

TraceSink = Callable[[dict[str, Any]], None]
SyncSink = Callable[[list[dict[str, Any]], int, int], None]
InUse = Callable[[], "str | None"]


@contextlib.contextmanager
def native_stderr_quiet() -> Any:
    """Silence file descriptor 2 inside the block: kineto prints ``profiler_start`` / ``profiler_stop`` lines
    that no setting turns off. ``sys.stderr`` is flushed first, so only those native lines are lost."""
    try:
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no real descriptor 2 (an embedded interpreter)
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class WindowStatus(enum.Enum):
    """What became of the torch.profiler window (report.json ``performance.profiler_window.status``)."""

    WRITTEN = "written"
    SKIPPED = "skipped"
    FAILED = "failed"
    NOT_REACHED = "not reached"


def torch_profiler_running() -> bool:
    """Whether a torch profiler records on this process now.

    torch has no public query: ``torch._C._autograd._profiler_enabled()`` is read when present, else the flag
    ``torch.autograd.profiler._is_profiler_enabled``; a torch with neither answers False, and the window's
    ``start()`` failing (caught) is then what tells. tests/unit/test_profiler_window.py pins both names.

    Example::

        >>> torch_profiler_running()
        False
        >>> from torch.profiler import profile
        >>> with native_stderr_quiet(), profile():
        ...     torch_profiler_running()
        True
    """
    query = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    if callable(query):
        with contextlib.suppress(Exception):
            return bool(query())
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def trace_summary(averages: Any, path: Path, first: int, last: int, uses_cuda: bool) -> dict[str, Any]:
    """The report's entry for one profiler trace: its file, steps and top operators.

    Example::

        >>> from types import SimpleNamespace as Op
        >>> ops = [Op(key="aten::mm", count=4, self_cpu_time_total=900.0, cpu_time_total=900.0)]
        >>> trace_summary(ops, Path("t.json"), 10, 14, False)["top_cpu"]
        ['aten::mm']
    """
    by_cpu = top_operators(averages, TOP_OPERATORS, by="self_cpu_ms")
    by_device = top_operators(averages, TOP_OPERATORS, by="self_device_ms") if uses_cuda else []
    return {"path": str(path), "first_step": first, "last_step": last,
            "by_self_cpu": [dataclasses.asdict(row) for row in by_cpu],
            "by_self_device": [dataclasses.asdict(row) for row in by_device],
            "top_cpu": [row.name for row in by_cpu[:5]], "top_device": [row.name for row in by_device[:5]]}


def trace_finding(trace: dict[str, Any]) -> Finding:
    """The ``profiler_trace`` event: where the trace is and what took the most CPU time."""
    return Finding(
        Kind.PROFILER_TRACE, Severity.INFO,
        f"torch.profiler trace of steps {trace['first_step']}-{trace['last_step']} written to {trace['path']} (open "
        f"it in Perfetto, chrome://tracing or TensorBoard); top operators by self CPU time: "
        f"{', '.join(trace['top_cpu'])}.",
        {"path": trace["path"], "first_step": trace["first_step"], "last_step": trace["last_step"],
         "top_cpu": trace["top_cpu"], "top_device": trace["top_device"]})


def sync_sites(counts: Counter[tuple[str, int]], package_dir: str = PACKAGE_DIR) -> list[dict[str, Any]]:
    """The lines that forced the most host-device synchronizations, each with whose code it is.

    Example::

        >>> sync_sites(Counter({("/site-packages/x.py", 3): 2, ("/home/me/train.py", 7): 5}))[0]["origin"]
        'user code'
    """
    sites = []
    for (filename, lineno), count in counts.most_common(MAX_SYNC_SITES):
        origin = ("lightning-debug" if filename.startswith(package_dir) else
                  "library" if "site-packages" in filename or "dist-packages" in filename else "user code")
        sites.append({"file": filename, "line": lineno, "count": count, "origin": origin,
                      "code": linecache.getline(filename, lineno).strip()})
    return sites


def host_sync_finding(sites: list[dict[str, Any]], total: int, window: tuple[int, int]) -> Finding | None:
    """The ``host_sync`` finding: a warning when user code synchronizes, an info when only libraries (or this
    plugin) do.

    Example::

        >>> site = {"file": "/home/me/train.py", "line": 7, "count": 5, "origin": "user code", "code": "x.item()"}
        >>> host_sync_finding([site], 5, (5, 3)).severity.value, host_sync_finding([], 0, (5, 3))
        ('warning', None)
    """
    if not sites:
        return None
    start, length = window
    user = [site for site in sites if site["origin"] == "user code"]
    shown = (user or sites)[:3]
    return Finding(
        Kind.HOST_SYNC, Severity.WARNING if user else Severity.INFO,
        f"{total} host-device synchronizations in steps {start}-{start + length - 1} "
        f"(torch.cuda.set_sync_debug_mode('warn')); "
        + "; ".join(f"{Path(s['file']).name}:{s['line']} `{s['code']}` x{s['count']}" for s in shown)
        + ". Each one stalls the CPU until the GPU catches up: keep values on the GPU (log tensors, not "
          ".item()), and avoid printing or branching on tensor values inside the step.",
        {"sites": sites, "first_step": start, "last_step": start + length - 1})


class StepWindows:
    """Runs torch.profiler over ``settings.profile_window`` and the sync-debug mode over ``settings.sync_window``
    (CUDA only). ``on_failure`` is told once per window when it is skipped or a trace cannot be written;
    ``in_use`` names who else records with torch.profiler (the framework's profiler), asked as the window opens.
    :attr:`outcome`: None until the window opens, then its :class:`WindowStatus` and why.

    Example::

        >>> windows = StepWindows(PerformanceSettings(profile_window=(0, 2), sync_window=(5, 3)), False, 0, None,
        ...                       print, print, print)
        >>> windows.until, windows.sync_window, [windows.boundary(step) for step in range(3)], windows.active
        (2, None, [False, False, False], False)

    Another profiler records already: the window is skipped, said once, and no profiler of ours is kept::

        >>> import tempfile
        >>> busy = StepWindows(PerformanceSettings(profile_window=(1, 2)), False, 0, Path(tempfile.mkdtemp()),
        ...                    print, print, print, in_use=lambda: "Lightning's PyTorchProfiler records this fit")
        >>> [busy.boundary(step) for step in range(4)], busy.active
        the torch.profiler window of profile_steps (steps 1-2) is skipped: Lightning's PyTorchProfiler records this fit; torch runs one profiler at a time.
        ([False, False, False, False], False)
        >>> busy.outcome["status"]
        <WindowStatus.SKIPPED: 'skipped'>
    """

    def __init__(self, settings: PerformanceSettings, uses_cuda: bool, rank: int, output_dir: Path | None,
                 on_trace: TraceSink, on_sync: SyncSink, on_failure: Callable[[str], None],
                 in_use: InUse | None = None) -> None:
        self.profile_window = settings.profile_window
        self.sync_window = settings.sync_window if uses_cuda else None
        self.uses_cuda, self.rank, self.output_dir = uses_cuda, rank, output_dir
        self.on_trace, self.on_sync, self.on_failure = on_trace, on_sync, on_failure
        self.in_use = in_use
        self.outcome: dict[str, Any] | None = None
        self.until = max((start + length for start, length in filter(None, (self.profile_window, self.sync_window))),
                         default=-1)
        self._profiler: Any = None
        self._profiler_step = -1
        self._profile_done = False
        self._sync_catcher: Any = None
        self._sync_records: list[warnings.WarningMessage] = []
        self._sync_previous_mode = 0
        self._sync_done = False

    @property
    def active(self) -> bool:
        """A window is open: the step's times include the profiler's or the sync debugging's cost."""
        return self._profiler is not None or self._sync_catcher is not None

    def boundary(self, step: int) -> bool:
        """Start or stop the windows as step ``step`` starts; True when one closed (its cost is no data wait)."""
        closed = False
        if self.profile_window is not None:
            start, length = self.profile_window
            end = start + length
            if self._profiler is not None and step != self._profiler_step:
                self._profiler_step = step
                try:
                    with native_stderr_quiet():
                        self._profiler.step()
                except Exception as failure:  # dropped, never touched again (see the module's docstring)
                    self._profiler, closed = None, True
                    self._drop(failure, f"at step {step}")
                else:
                    if step >= end:
                        self.stop_profiler()
                        closed = True
            elif self._profiler is None and not self._profile_done and max(start - 1, 0) <= step < end:
                self._start_profiler(step, start, end)
        if self.sync_window is not None and not self._sync_done:
            start, length = self.sync_window
            if self._sync_catcher is None and start <= step < start + length:
                self._start_sync_window()
            elif self._sync_catcher is not None and step >= start + length:
                self.end_sync_window(step)
                closed = True
        return closed

    def _settle(self, status: WindowStatus, reason: str | None = None) -> str:
        start, length = self.profile_window  # type: ignore[misc]
        self.outcome = {"status": status, "first_step": start, "last_step": start + length - 1, "reason": reason}
        return f"steps {start}-{start + length - 1}"

    def _give_up(self, status: WindowStatus, reason: str) -> None:
        """The window is skipped (another profiler holds torch's) or dropped: said once, and in :attr:`outcome`."""
        steps = self._settle(status, reason)
        outcome = (f"is skipped: {reason}; torch runs one profiler at a time" if status is WindowStatus.SKIPPED
                   else f"was dropped: {reason}; training continues")
        self.on_failure(f"the torch.profiler window of profile_steps ({steps}) {outcome}.")

    def _drop(self, failure: Exception, when: str) -> None:
        """Our profiler raised ``when`` and is dropped."""
        reason = f"{type(failure).__name__}: {failure}"
        if "already enabled" in str(failure):
            self._give_up(WindowStatus.SKIPPED,
                          f"another torch profiler records on this thread (our profiler raised {when}: {reason})")
        else:
            self._give_up(WindowStatus.FAILED, f"torch.profiler raised {when} ({reason})")

    def not_reached(self, step: int) -> None:
        """The run ended before the window opened: say so in :attr:`outcome`."""
        if self.profile_window is not None and self.outcome is None and not self._profile_done:
            self._settle(WindowStatus.NOT_REACHED, f"the run ended at step {step}, before the window")

    def _start_profiler(self, step: int, start: int, end: int) -> None:
        self._profile_done = True
        if self.output_dir is None:
            return
        other = None  # who else records with torch.profiler now, in words
        if self.in_use is not None:
            with contextlib.suppress(Exception):
                other = self.in_use()
        if not other and torch_profiler_running():
            other = ("a torch profiler is already recording on this process (torch.profiler.profile or "
                     "torch.autograd.profiler.profile started outside lightning-debug)")
        if other:
            self._give_up(WindowStatus.SKIPPED, other)
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = 1 if step < start else 0
        active = end - max(step + warmup, start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.uses_cuda else [])
        first, last = step + warmup, end - 1

        def on_trace_ready(profiler: Any) -> None:
            try:
                self._trace_ready(profiler, first, last)
            except Exception as failure:  # a full disk must not stop training
                reason = f"the trace could not be written ({type(failure).__name__}: {failure})"
                self._settle(WindowStatus.FAILED, reason)
                self.on_failure(f"the torch.profiler trace of steps {first}-{last} could not be written "
                                f"({type(failure).__name__}: {failure}); training continues.")

        profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                           on_trace_ready=on_trace_ready)
        try:
            with native_stderr_quiet():
                profiler.start()
        except Exception as failure:  # never kept: stepping, stopping or exporting it can crash the process
            self._drop(failure, "as it started")
            return
        self._profiler, self._profiler_step = profiler, step

    def _trace_ready(self, profiler: Any, first: int, last: int) -> None:
        directory = self.output_dir / "profiler"  # type: ignore[operator]
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{self.rank}.steps{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        self._settle(WindowStatus.WRITTEN, None)
        self.outcome["path"] = str(path)  # type: ignore[index]
        self.on_trace(trace_summary(profiler.key_averages(), path, first, last, self.uses_cuda))

    def stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            try:
                with native_stderr_quiet():
                    profiler.stop()
            except Exception as failure:
                self._drop(failure, "as it stopped")

    def _start_sync_window(self) -> None:
        self._sync_previous_mode = torch.cuda.get_sync_debug_mode()
        self._sync_catcher = warnings.catch_warnings(record=True)
        self._sync_records = self._sync_catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def end_sync_window(self, step: int) -> None:
        """Close the sync-debug window (if open): count the sync warnings by line, issue the others again."""
        if self._sync_catcher is None:
            return
        self._close_sync()
        self._sync_done = True
        records, self._sync_records = self._sync_records, []
        counts: Counter[tuple[str, int]] = Counter()
        for record in records:
            if "synchroniz" in str(record.message):
                counts[(record.filename, record.lineno)] += 1
            else:
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
        self.on_sync(sync_sites(counts), sum(counts.values()), step)

    def restore(self) -> None:
        """Undo global changes (profiler running, sync debug mode) whatever happened."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            with contextlib.suppress(Exception):
                profiler.stop()
        if self._sync_catcher is not None:
            self._close_sync()

    def _close_sync(self) -> None:
        torch.cuda.set_sync_debug_mode(self._sync_previous_mode)
        self._sync_catcher.__exit__(None, None, None)
        self._sync_catcher = None
