"""events.jsonl: one JSON object per finding, flushed per line so a crash loses nothing found."""

from __future__ import annotations

import datetime
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class EventLog:
    """Appends events to ``<directory>/events.jsonl``; a ``None`` directory writes nothing.

    A failure to write (unwritable or full disk) turns into one warning, and later writes are
    dropped: monitoring must never stop training.
    """

    FILENAME = "events.jsonl"

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / self.FILENAME if directory is not None else None
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None or self._failed:
            return
        record = dict(record)
        record.setdefault("time", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(_jsonable(record), allow_nan=False) + "\n"
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()
                if record.get("severity") in ("error", "critical"):
                    os.fsync(handle.fileno())
        except OSError as error:
            self._failed = True
            warnings.warn(f"lightning-debug could not write {self.path} ({error}); events are no longer saved, "
                          "training continues.", RuntimeWarning, stacklevel=2)


def read_events(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The events of an events.jsonl file, and whether its last line was truncated (and skipped)."""
    events: list[dict[str, Any]] = []
    truncated = False
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                truncated = True
            else:
                raise ValueError(f"{path}:{number + 1} is not valid JSON")
    return events, truncated
