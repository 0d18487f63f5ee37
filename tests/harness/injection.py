"""Fault injection into every method the plugin runs during a training step, found by introspection.

:func:`candidate_methods` lists every function defined on :class:`~lightning_debug.run.Run`, on
:class:`~lightning_debug.core.monitor.Monitor` and on every subclass of it in the package (no hand-written
list). :class:`Injector` wraps each of them on one rank: every call is noted (so the methods that run during a
step are those called between the run's start and its end), and at most one armed method raises once, at the
step it is armed for.

Left out, found by introspection too: the Run's event entries (:func:`event_entries`, the methods wrapped by
``run._own_time`` that an adapter calls: ``batch_start``, ``before_optimizer_step``, ...). They are the gate
itself: each guards its body, and ``before_optimizer_step`` and ``batch_end`` make the step's collectives
there, after the guarded work. Every method they call is injected.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

PLANTED = "planted failure in"


def monitor_classes() -> list[type]:
    """Monitor and every subclass of it defined in the package (every module of ``lightning_debug.monitors``)."""
    import lightning_debug.monitors as monitors
    from lightning_debug.core.monitor import Monitor

    for module in pkgutil.walk_packages(monitors.__path__, "lightning_debug.monitors."):
        importlib.import_module(module.name)
    found, todo = [], [Monitor]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("lightning_debug.") and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def event_entries() -> list[str]:
    """The Run's event entries: its methods wrapped by ``run._own_time`` (they carry ``__wrapped__``)."""
    from lightning_debug.run import Run

    return sorted(name for name, value in vars(Run).items() if inspect.isfunction(value) and hasattr(value, "__wrapped__"))


def candidate_methods() -> list[tuple[type, str]]:
    """Every plain function defined on the Run and on each monitor class, with its owner (dunders and the Run's
    event entries left out)."""
    from lightning_debug.run import Run

    entries = set(event_entries())
    methods = []
    for cls in [Run, *monitor_classes()]:
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not (name.startswith("__") and name.endswith("__")) \
                    and not (cls is Run and name in entries):
                methods.append((cls, name))
    return methods


class Injector:
    """Wraps every candidate method: notes who is called during steps, raises once in the armed one.

    ``during`` tells whether training is between its start and its end. ``arm(name, step)`` makes ``name`` raise
    at its next call (the caller arms it just before ``step`` starts and disarms it when it ends).
    """

    def __init__(self, during: Callable[[], bool]) -> None:
        self.during = during
        self.seen: list[str] = []  # in the order first called during a step
        self.recent: set[str] = set()  # called since the last arm: likely to be called at the next step too
        self.fired: list[tuple[str, int]] = []
        self.armed: tuple[str, int] | None = None
        self._restore: list[tuple[type, str, Any]] = []
        for cls, name in candidate_methods():
            original = vars(cls)[name]
            self._restore.append((cls, name, original))
            setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", original))

    def _wrap(self, qualified: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def injected(*args: Any, **kwargs: Any) -> Any:
            if self.during():
                if qualified not in self.seen:
                    self.seen.append(qualified)
                self.recent.add(qualified)
                armed = self.armed
                if armed is not None and armed[0] == qualified:
                    self.armed = None
                    self.fired.append((qualified, armed[1]))
                    raise RuntimeError(f"{PLANTED} {qualified} at step {armed[1]}")
            return function(*args, **kwargs)

        injected.__name__ = getattr(function, "__name__", "injected")
        injected.__wrapped__ = function  # type: ignore[attr-defined]
        return injected

    def arm(self, name: str | None, step: int) -> None:
        self.armed = (name, step) if name is not None else None
        if name is not None:
            self.recent = set()

    def remove(self) -> None:
        for cls, name, original in reversed(self._restore):
            setattr(cls, name, original)


class Schedule:
    """Which method to arm at each step: every method seen during a step, once at a NaN step and once at a
    healthy one, one injection per step, in the order the methods were first seen. A method armed but not
    called at its step is tried again at a later step of the same kind (at most ``tries`` times)."""

    def __init__(self, tries: int = 3) -> None:
        self.tries = tries
        self.done: dict[tuple[str, bool], str] = {}  # (method, at a NaN step) -> "fired" or "not reached"
        self.attempts: dict[tuple[str, bool], int] = {}
        self.current: tuple[str, bool] | None = None  # armed for the step under way

    def next(self, seen: list[str], nan_step: bool, recent: set[str] = frozenset()) -> str | None:
        """The method to arm at a step of this kind: those called at the last steps first (an ``epoch_start``
        waits for the end of the epoch rather than using up its tries)."""
        for name in [name for name in seen if name in recent] + [name for name in seen if name not in recent]:
            key = (name, nan_step)
            if key not in self.done:
                self.attempts[key] = self.attempts.get(key, 0) + 1
                if self.attempts[key] > self.tries:
                    self.done[key] = "not reached"
                    continue
                return name
        return None

    def result(self, name: str, nan_step: bool, fired: bool) -> None:
        if fired:
            self.done[(name, nan_step)] = "fired"

    def pending(self, seen: list[str]) -> int:
        return sum((name, kind) not in self.done for name in seen for kind in (False, True))


def problems(results: list[dict[str, Any]], steps: int) -> list[str]:
    """What two ranks' results (``ddp_worker.py`` with injections on rank 1) break of issue 43's contract: both
    ranks ran every step without an exception, took the same decision at every step, ended with the same weights,
    made the same collectives (the gate's log), and every injection that fired on rank 1 is a failed check of
    rank 1 in rank 0's report, at its step (an ``epoch_start`` is still counted at the last batch's step)."""
    import math

    zero, one = results
    found = []
    if zero["exception"] or one["exception"]:
        found.append(f"an exception: {zero['exception']} / {one['exception']}")
    if not zero["global_step"] == one["global_step"] == steps:
        found.append(f"steps {zero['global_step']} / {one['global_step']}, expected {steps}")
    if zero["decisions"] != one["decisions"]:
        differ = [(a, b) for a, b in zip(zero["decisions"], one["decisions"]) if a != b]
        found.append(f"decisions differ: {differ[:5]}")
    a, b = zero["param_checksum"], one["param_checksum"]
    if not (a == b or (math.isnan(a) and math.isnan(b))):
        found.append(f"weights differ: {a} / {b}")
    if zero["gate_log"] != one["gate_log"]:
        found.append("the gate made different collectives on the two ranks")
    report = zero["report_failed_checks"]
    for name, step in one.get("fired", []):
        if not any(1 in entry.get("ranks", []) and entry["first_step"] <= step and entry["last_step"] >= step - 1
                   for entry in report.values()):
            found.append(f"{name} failed at step {step} on rank 1 but no failed check of rank 1 covers it")
    return found
