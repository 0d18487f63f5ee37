"""The console: every line the plugin shows during a run goes through the ``lightning_debug`` logger.

Python warnings were the wrong channel: the common ``warnings.filterwarnings("ignore")`` of a training
script hid every finding, and the line was written into the middle of a progress bar. A logger is what
a training script configures on purpose. :data:`LOGGER` carries one :class:`ConsoleHandler`: when the
process has a logging configuration of its own (a handler on the root logger), the line goes there and
the handler stays out of the way; otherwise the handler prints it, through the printer an adapter routes
it to while a run is live (Lightning: the active progress bar's ``print``, which clears and redraws the
bar) or to ``stderr``. One record is one line.

Example::

    >>> seen = []
    >>> listener = logging.Handler()
    >>> listener.emit = lambda record: seen.append(record.getMessage())
    >>> LOGGER.addHandler(listener)
    >>> with warnings.catch_warnings():
    ...     warnings.filterwarnings("ignore")  # hides warnings, not this line
    ...     notify("lightning-debug: [step 3] The loss is NaN/Inf at step 3 (nonfinite_loss).")
    >>> LOGGER.removeHandler(listener); seen
    ['lightning-debug: [step 3] The loss is NaN/Inf at step 3 (nonfinite_loss).']
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings  # noqa: F401  (the example)
from collections.abc import Callable, Iterator

LOGGER_NAME = "lightning_debug"
LOGGER = logging.getLogger(LOGGER_NAME)
Printer = Callable[[str], None]


class ConsoleHandler(logging.Handler):
    """Prints a record as one line: to the routed printer (the active progress bar), else ``stderr``; nothing
    when the root logger has handlers, which then show the record (the user's logging configuration)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.printers: list[Printer] = []

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            line = " ".join(self.format(record).split("\n"))
            if self.printers:
                try:
                    self.printers[-1](line)
                    return
                except Exception:
                    pass
            stream = sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            pass


def _handler() -> ConsoleHandler:
    handler = next((h for h in LOGGER.handlers if isinstance(h, ConsoleHandler)), None)
    if handler is None:
        handler = ConsoleHandler()
        LOGGER.addHandler(handler)
    return handler


HANDLER = _handler()


def notify(message: str, level: int = logging.WARNING) -> None:
    """Show ``message`` to the user as one line through :data:`LOGGER`; never raises (a failing handler must not
    make a write fail on one rank and keep it from what every rank does next: the line is in events.jsonl)."""
    try:
        LOGGER.log(level, message)
    except Exception:
        pass


@contextlib.contextmanager
def routed(printer: Printer | None) -> Iterator[None]:
    """While the block runs, the handler prints through ``printer`` (None: ``stderr``)."""
    if printer is None:
        yield
        return
    HANDLER.printers.append(printer)
    try:
        yield
    finally:
        if printer in HANDLER.printers:
            HANDLER.printers.remove(printer)


def route(printer: Printer) -> Callable[[], None]:
    """Print through ``printer`` until the returned function is called (a run's lifetime)."""
    HANDLER.printers.append(printer)

    def unroute() -> None:
        if printer in HANDLER.printers:
            HANDLER.printers.remove(printer)

    return unroute
