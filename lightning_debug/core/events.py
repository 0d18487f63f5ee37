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

    A failure to write (unwritable or full disk, an invalid path) is recorded in ``failures`` (one
    warning) and later writes are dropped: monitoring must never stop training.
    """

    def __init__(self, directory: Path | None, failures: Failures) -> None:
        self.path = directory / EVENTS_FILENAME if directory is not None else None
        self.failures = failures
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None or self._failed:
            return
        record = dict(record)
        record.setdefault("time", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(jsonable(record), allow_nan=False) + "\n"
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()
                if record.get("severity") in ("error", "critical"):
                    os.fsync(handle.fileno())
        except Exception as error:
            self._failed = True
            self.failures.record(f"writing {self.path}", error, "events are no longer saved")
