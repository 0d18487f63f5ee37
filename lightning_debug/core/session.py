"""One run's shared outputs: its directory and id, events.jsonl, the logger scalars, the timeline, the failures.

Writing never raises: a failure is recorded and the caller goes on, so a write failing on one rank cannot keep it
from a collective the others take.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_debug.core.events import EventLog
from lightning_debug.core.findings import EpisodePhase, Finding
from lightning_debug.core.gate import Gate
from lightning_debug.core.guard import Failures
from lightning_debug.core.metrics import MetricsSink, MetricsWriter
from lightning_debug.core.own_time import OwnTime
from lightning_debug.core.timeline import Timeline

Where = dict[str, int]
EventListener = Callable[[dict[str, Any]], None]
DocumentWriter = Callable[[Path, str, Any], Path]
RUN_MARKERS = ("events.jsonl", "report.json")


def new_run_id(now: datetime.datetime | None = None) -> str:
    """A run id that sorts by start time and is unique: ``20260101-120000-3fa2c1`` (UTC).

    Example::

        >>> new_run_id(datetime.datetime(2026, 1, 2, 3, 4, 5))[:16]
        '20260102-030405-'
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def run_directory(configured: str, base: Path | None, run_id: str, base_is_per_run: bool) -> Path:
    """Where a run's files go: ``debug_output_dir`` under ``base`` when ``base`` is already this run's own directory
    (a logger's ``version_N``) without an earlier run's files, else a ``<run_id>`` directory below it. Decide on
    one process and share the result (the file system may differ between nodes).

        >>> import tempfile
        >>> base = Path(tempfile.mkdtemp())
        >>> run_directory("debug_outputs", base, "r1", True) == base / "debug_outputs"
        True
        >>> run_directory("debug_outputs", base, "r1", False) == base / "debug_outputs" / "r1"
        True
    """
    path = Path(configured).expanduser()
    if path.is_absolute() or base is None:
        return path / run_id
    path = base / path
    if base_is_per_run and not any((path / marker).exists() for marker in RUN_MARKERS):
        return path
    return path / run_id


class Session:
    """Shared writers of one run (``output_dir`` None: no files); only the global-zero process writes events and
    scalars, and ``rank`` names the documents each process writes.

        >>> from lightning_debug.core.kinds import Kind, Severity
        >>> session = Session(None, True, None, Failures())
        >>> seen = []; session.event_listeners.append(seen.append)
        >>> session.emit(Finding(Kind.SLOW_STEP, Severity.WARNING, "slow"), step=3, where={"epoch": 0, "batch": 3},
        ...              callback="PerformanceProfilerCallback")
        >>> seen[0]["kind"], seen[0]["step"]
        ('slow_step', 3)
    """

    def __init__(self, output_dir: Path | None, is_global_zero: bool, sink: MetricsSink | None,
                 failures: Failures, rank: int = 0, *, run_id: str | None = None,
                 log_every_n_steps: int | None = None,
                 exposed: Callable[[dict[str, float]], None] | None = None, rows: bool = False) -> None:
        self.is_global_zero = is_global_zero
        self.files_dir = output_dir
        self.output_dir = output_dir if is_global_zero else None
        self.rank = rank
        self.run_id = run_id
        self.failures = failures
        self.gate = Gate(failures)  # the run's (every collective of the plugin), shared with the monitors
        self.events = EventLog(self.output_dir, failures)
        self.timeline = Timeline()
        self.event_listeners: list[EventListener] = [self.timeline.observe_event]
        self.links: dict[str, str] = {}
        self.metrics = MetricsWriter(sink if is_global_zero else None, failures, log_every_n_steps,
                                     observer=self.timeline.observe_metrics if is_global_zero else None,
                                     exposed=exposed, rows=rows and is_global_zero)
        self.document_writer: DocumentWriter | None = None
        self.own_time = OwnTime()  # the run's own host time: step timing leaves it out

    def emit(self, finding: Finding, *, step: int, where: Where, callback: str,
             episode: EpisodePhase | None = None, console: bool = True) -> None:
        """Write one event (global zero only) and hand it to the listeners (timeline, TensorBoard text, console)."""
        record: dict[str, Any] = {
            "step": step, "epoch": where.get("epoch", -1), "batch": where.get("batch", -1),
            "kind": finding.kind.value, "severity": finding.severity.value, "callback": callback,
            "message": finding.message, "details": finding.details,
        }
        if "optimizer" in where:
            record["optimizer"] = where["optimizer"]
        if episode is not None:
            record["episode"] = episode.value
        if self.run_id is not None:
            record["run"] = self.run_id
        self.events.write(record)
        if self.is_global_zero:
            seen = dict(record, console=console)
            for listener in list(self.event_listeners):
                try:
                    listener(seen)
                except Exception as failure:
                    self.event_listeners.remove(listener)
                    self.failures.record(f"event listener {type(listener).__name__}", failure,
                                         "it was removed (events.jsonl still has every event)")

    def write_document(self, stem: str, step: int, document: Any) -> Path | None:
        """Write a document (an OOM post-mortem) next to the events, on any rank; None when this run writes no files."""
        if self.files_dir is None or self.document_writer is None:
            return None
        name = f"{stem}_step{step}" + (f"_rank{self.rank}" if self.rank else "")
        return self.document_writer(self.files_dir, name, document)

    def file_path(self, stem: str, step: int, suffix: str) -> Path | None:
        """Where a rank's own file (a memory snapshot) goes, or None when this run writes no files."""
        if self.files_dir is None:
            return None
        self.files_dir.mkdir(parents=True, exist_ok=True)
        return self.files_dir / (f"{stem}_step{step}" + (f"_rank{self.rank}" if self.rank else "") + suffix)
