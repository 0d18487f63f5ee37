"""Monitoring never breaks training: the one failure policy of the whole package, and the console it speaks through.

Every check, write and hook goes through :class:`Failures`: a failure becomes one console line per check, is
counted for the report, and the run goes on. :class:`~lightning_debug.AnomalyError` and anything not an
``Exception`` pass through untouched.

Example::

    >>> seen = []
    >>> listener = logging.Handler()
    >>> listener.emit = lambda record: seen.append(record.getMessage())
    >>> LOGGER.addHandler(listener)
    >>> failures = Failures()
    >>> for step in range(3):
    ...     failures.step = step
    ...     failures.call("gradients.check", lambda: 1 / 0)
    >>> LOGGER.removeHandler(listener)
    >>> len(seen), failures.summary()["gradients.check"]["count"]
    (1, 3)
    >>> seen[0]
    'lightning-debug: gradients.check failed at step 0 (ZeroDivisionError: division by zero); this check is skipped, training continues.'

Lines go through the ``lightning_debug`` logger, not Python warnings (which ``filterwarnings("ignore")`` silences).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_debug.errors import AnomalyError

LOGGER_NAME = "lightning_debug"
LOGGER = logging.getLogger(LOGGER_NAME)
Printer = Callable[[str], None]


class ConsoleHandler(logging.Handler):
    """Prints a record as one line: to the routed printer (the progress bar), else ``stderr``; nothing when the
    root logger has handlers (the user's logging configuration shows it)."""

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
    """Show ``message`` as one line through :data:`LOGGER`; never raises (a failing handler must not keep one rank
    from what every rank does next)."""
    try:
        LOGGER.log(level, message)
    except Exception:
        pass


def route(printer: Printer) -> Callable[[], None]:
    """Print through ``printer`` until the returned function is called (a run's lifetime)."""
    HANDLER.printers.append(printer)

    def unroute() -> None:
        if printer in HANDLER.printers:
            HANDLER.printers.remove(printer)

    return unroute


CallableT = TypeVar("CallableT", bound=Callable[..., Any])
MAX_REASONS = 5


class Failures:
    """Which checks failed, how often, since when and why; each warns once. ``step``: the run's current step."""

    def __init__(self) -> None:
        self.step = -1
        self.failed: dict[str, dict[str, Any]] = {}

    def call(self, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``, or None after recording its failure."""
        try:
            return function(*args, **kwargs)
        except AnomalyError:
            raise
        except Exception as failure:
            self.record(name, failure)
            return None

    def record(self, name: str, failure: BaseException, consequence: str = "this check is skipped",
               step: int | None = None) -> None:
        """Count ``failure`` of check ``name``; the first one of each check becomes a warning."""
        step = self.step if step is None else step
        reason = f"{type(failure).__name__}: {describe(failure)}"
        entry = self.failed.get(name)
        if entry is None:
            entry = self.failed[name] = {"count": 0, "first_step": step, "last_step": step, "reasons": {}}
            at = f" at step {step}" if step >= 0 else ""
            notify(f"lightning-debug: {name} failed{at} ({reason}); {consequence}, training continues.")
        entry["count"] += 1
        entry["first_step"] = min(entry["first_step"], step)
        entry["last_step"] = max(entry["last_step"], step)
        reasons = entry["reasons"]
        if reason in reasons or len(reasons) < MAX_REASONS:
            reasons[reason] = reasons.get(reason, 0) + 1

    def __bool__(self) -> bool:
        return bool(self.failed)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per failed check: how often, first and last step, and the reasons with their counts."""
        return {name: {**entry, "reasons": dict(entry["reasons"])} for name, entry in self.failed.items()}


def guarded_hook(failures: Failures, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as torch calls it inside the user's forward (a module's forward hook), through ``failures``: a check
    that fails there is recorded and skipped, never raised into the user's ``training_step``; it returns None, which
    leaves the module's output as it was.

        >>> failures = Failures()
        >>> hook = guarded_hook(failures, "ActivationMonitor.observe", lambda module, args, output: 1 / 0)
        >>> hook(None, (), None) is None, failures.failed["ActivationMonitor.observe"]["count"]
        (True, 1)
    """

    def call(*args: Any) -> Any:
        return failures.call(name, hook, *args)

    return call


def describe(error: BaseException) -> str:
    """``str(error)``, or a note that it raised: a user's exception with a broken ``__str__`` must still propagate.

        >>> class Broken(Exception):
        ...     def __str__(self): raise RuntimeError("no")
        >>> describe(ValueError("bad value")), describe(Broken())
        ('bad value', '<str() of this Broken raised RuntimeError>')
    """
    try:
        return str(error)
    except Exception as failure:
        return f"<str() of this {type(error).__name__} raised {type(failure).__name__}>"


def guarded(method: CallableT) -> CallableT:
    """Run a method through its owner's ``failures`` (a :class:`Failures`), named ``Class.method``."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.failures.call(f"{type(self).__name__}.{method.__name__}", method, self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
