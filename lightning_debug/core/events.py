"""events.jsonl: one JSON object per finding, flushed per line so a crash loses nothing found."""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Any

from lightning_debug.core.guard import Failures

EVENTS_FILENAME = "events.jsonl"


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings and anything unknown as its ``str``: always valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class EventLog:
    """Appends events to ``<directory>/events.jsonl``; a ``None`` directory writes nothing.

    A failed write (a disk full for a while) is recorded once and its line kept for the next write, so nothing is
    lost; past :attr:`max_pending` lines the oldest are dropped and counted; a line cut off by a crash is ended first.
        >>> import tempfile
        >>> log = EventLog(Path(tempfile.mkdtemp()), Failures())
        >>> log.write({"step": 1, "kind": "slow_step"}); log.pending, log.path.read_text().count("\\n")
        (0, 1)
    """

    max_pending: int = 1000

    def __init__(self, directory: Path | None, failures: Failures) -> None:
        self.path = directory / EVENTS_FILENAME if directory is not None else None
        self.failures = failures
        self._pending: list[str] = []
        self._lost = 0
        self._lost_from = 0
        self._failed = False
        self._check_end = True  # the first write, and the first after a failure, ends a line left cut

    @property
    def pending(self) -> int:
        """Lines waiting for a write that works."""
        return len(self._pending)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        record = dict(record)
        record.setdefault("time", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"))
        try:
            line = json.dumps(jsonable(record), allow_nan=False) + "\n"
        except Exception as error:  # a record that cannot be written is this event's loss only
            self.failures.record(f"writing {self.path}", error, "this event is lost")
            return
        self._pending.append(line)
        if len(self._pending) > self.max_pending:
            if not self._lost:
                self._lost_from = int(json.loads(self._pending[0]).get("step", 0))
            del self._pending[0]
            self._lost += 1
        self._flush(sync=record.get("severity") in ("error", "critical"))

    def _flush(self, sync: bool) -> None:
        path = self.path
        assert path is not None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a+b") as handle:
                if self._check_end and handle.tell() > 0:
                    handle.seek(-1, os.SEEK_END)
                    if handle.read(1) != b"\n":
                        handle.write(b"\n")
                if self._lost:
                    handle.write(self._lost_line().encode("utf-8"))
                handle.write("".join(self._pending).encode("utf-8"))
                handle.flush()
                if sync or self._failed:
                    os.fsync(handle.fileno())
        except Exception as error:
            self._failed = self._check_end = True
            self.failures.record(f"writing {self.path}", error,
                                 "the events are kept and written with the next one that can be")
            return
        self._pending.clear()
        self._lost = 0
        self._failed = self._check_end = False

    def _lost_line(self) -> str:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        return json.dumps({"step": max(self._lost_from, 0), "kind": "events_lost", "severity": "warning", "time": now,
                           "message": f"{self._lost} event(s) could not be written (the disk was full or unwritable "
                                      f"for longer than {self.max_pending} events); report.json still counts them",
                           "details": {"lost": self._lost}}) + "\n"
