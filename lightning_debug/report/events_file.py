"""Reading events.jsonl defensively (files from a crash, a full disk or someone else): streamed, every line checked
against the event schema, a bad one skipped and counted, a cut-off last line noted as such.

Example::

    >>> import json, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "events.jsonl"
    >>> _ = path.write_text(json.dumps({"step": 3, "kind": "slow_step"}) + "\\n" + '{"step": -1, "kind": "x"}\\n')
    >>> events = read_events_file(path)
    >>> [record["step"] for record in events.records], events.bad_lines
    ([3], 1)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 1 << 20
BAD_LINES_SHOWN = 3
MAX_MESSAGE = 2000  # characters of a message kept
MAX_NAME = 200  # characters of a kind, severity, callback, run id or key kept
MAX_RUN_IDS = 1000  # run ids remembered to tell an earlier run's events
KEPT_DETAILS = ("first_step", "last_step", "steps", "episodes", "key", "consequence_of")
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with control characters, bidirectional overrides and lone surrogates written as escapes, so a
    hostile events.jsonl cannot drive the terminal it is printed on or make the report unwritable as UTF-8.

    Example::

        >>> printable("red \\x1b[31mNaN\\x1b[0m\\n"), printable("plain")
        ('red \\\\x1b[31mNaN\\\\x1b[0m\\\\x0a', 'plain')
    """
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(lambda match: (f"\\x{ord(match.group()):02x}" if ord(match.group()) < 0x100
                                           else f"\\u{ord(match.group()):04x}"), text)


def _kept(record: dict[str, Any]) -> dict[str, Any]:
    """What the report uses of a valid event, its texts cut and made printable: memory bounded by what is kept."""
    kept: dict[str, Any] = {}
    for key, value in record.items():
        if key == "details" and isinstance(value, dict):
            kept[key] = {name: (printable(value[name][:MAX_NAME]) if isinstance(value[name], str) else value[name])
                         for name in KEPT_DETAILS if name in value and isinstance(value[name], (int, str))}
        elif isinstance(value, str):
            kept[key] = printable(value[:MAX_MESSAGE if key == "message" else MAX_NAME])
        elif isinstance(value, (int, float, bool)) or value is None:
            kept[key] = value
    return kept


@dataclass
class EventsScan:
    """What reading events.jsonl found besides its events (which are streamed, not kept)."""

    read: int = 0
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    truncated_last_line: bool = False
    run: str | None = None
    earlier_runs: int = 0
    other_run_events: int = 0

    def reject(self, where: str, why: str) -> None:
        self.bad += 1
        if len(self.bad_examples) < BAD_LINES_SHOWN:
            self.bad_examples.append(f"{where}: {why}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2 ** 62) < value < 2 ** 62


def event_problem(record: Any) -> str | None:
    """Why ``record`` is not a lightning-debug event (None when it is one).

    Example::

        >>> event_problem({"step": 3, "kind": "slow_step"}), event_problem({"step": "3", "kind": "slow_step"})
        (None, "'step' is not an integer")
    """
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str) or not 0 < len(record["kind"]) <= 100:
        return "not a lightning-debug event (needs an object with 'kind' and an integer 'step')"
    if not is_int(record.get("step")) or record["step"] < 0:
        return "'step' is not an integer" if not is_int(record.get("step")) else "'step' is negative"
    for key in ("severity", "message", "callback", "run"):
        if key in record and record[key] is not None and not isinstance(record[key], str):
            return f"'{key}' is not a string"
    for key in ("epoch", "batch"):
        if key in record and not is_int(record[key]):
            return f"'{key}' is not an integer"
    if record.get("episode") not in (None, "start", "end", "summary"):
        return "'episode' is not 'start', 'end' or 'summary'"
    details = record.get("details")
    if details is not None and not isinstance(details, dict):
        return "'details' is not an object"
    for key in ("first_step", "last_step", "steps", "episodes"):
        if details and key in details and not is_int(details[key]):
            return f"'details.{key}' is not an integer"
    if details and "key" in details and not isinstance(details["key"], (str, type(None))):
        return "'details.key' is not a string"
    return None


def _lines(path: Path) -> Iterator[tuple[int, bytes | None, bool]]:
    """``(number, line, complete)`` of a file read in bounded pieces; a line over :data:`MAX_LINE_BYTES` is None."""
    with open(path, "rb") as stream:
        number = 0
        while True:
            line = stream.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = stream.readline(MAX_LINE_BYTES)
                yield number, None, True
                continue
            yield number, line, line.endswith(b"\n")


def iter_events(path: Path, scan: EventsScan, trim: bool = True) -> Iterator[dict[str, Any]]:
    """The valid events of ``path``, one at a time, bad lines counted in ``scan``; with ``trim``, each cut to what
    the report uses (:func:`_kept`)."""
    for number, line, complete in _lines(path):
        where = f"{path.name}:{number}"
        if line is None:
            scan.reject(where, f"longer than {MAX_LINE_BYTES} bytes")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            scan.reject(where, f"not UTF-8 text ({error.reason} at byte {error.start})")
            continue
        except RecursionError:
            scan.reject(where, "JSON nested too deep")
            continue
        except ValueError as error:
            if not complete:
                scan.truncated_last_line = True
            else:
                scan.reject(where, f"not valid JSON ({getattr(error, 'msg', error)})")
            continue
        problem = event_problem(record)
        if problem is not None:
            scan.reject(where, problem)
            continue
        scan.read += 1
        yield _kept(record) if trim else record


@dataclass
class EventsFile:
    """All valid events of a (small) events.jsonl, whole, for tests and tools."""

    records: list[dict[str, Any]]
    truncated_last_line: bool
    bad_lines: int = 0


def read_events_file(path: Path) -> EventsFile:
    scan = EventsScan()
    records = list(iter_events(path, scan, trim=False))
    return EventsFile(records, scan.truncated_last_line, scan.bad)


def last_run(records: Iterable[dict[str, Any]], scan: EventsScan) -> Iterator[dict[str, Any]]:
    """The events of the last run of a file several runs appended to: a new run id yields ``{}`` (the consumer
    starts afresh); events of a run seen earlier are counted, not used. At most :data:`MAX_RUN_IDS` ids are
    remembered, so memory stays bounded (an event of a forgotten run then starts a run afresh)."""
    seen: set[Any] = set()
    started = False
    for record in records:
        run = record.get("run")
        if not started or (run != scan.run and run not in seen):
            if started:
                scan.earlier_runs += 1
                yield {}
            started = True
            if len(seen) < MAX_RUN_IDS:
                seen.add(run)
            scan.run = run
        elif run != scan.run:
            scan.other_run_events += 1
            continue
        yield record
