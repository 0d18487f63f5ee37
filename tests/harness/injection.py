"""Fault injection into every method the plugin runs during a training step, found by introspection.

:func:`candidate_methods` lists every function defined on :class:`~lightning_debug.run.Run`, on
:class:`~lightning_debug.core.monitor.Monitor` and on every subclass of it in the package (no hand-written
list). :class:`Injector` wraps each of them on one rank: every call is noted (so the methods that run during a
step are those called between the run's start and its finalize), and at most one armed method raises once,
at the step it is armed for. A Run event entry (wrapped by ``run._own_time``) is injected inside that wrapper,
into its body, as a failure of the event's own code: the adapter's call into the run is not the plugin's check.
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


def candidate_methods() -> list[tuple[type, str]]:
    """Every plain function defined on the Run and on each monitor class, with its owner (dunders left out)."""
    from lightning_debug.run import Run

    methods = []
    for cls in [Run, *monitor_classes()]:
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not (name.startswith("__") and name.endswith("__")):
                methods.append((cls, name))
    return methods


class Injector:
    """Wraps every candidate method: notes who is called during steps, raises once in the armed one.

    ``during`` tells whether training is between its start and its end. ``arm(name, step)`` makes ``name`` raise
    at its next call (the caller arms it just before ``step`` starts and disarms it when it ends).
    """

    def __init__(self, during: Callable[[], bool]) -> None:
        import lightning_debug.run as run_module

        self.during = during
        self.seen: list[str] = []  # in the order first called during a step
        self.fired: list[tuple[str, int]] = []
        self.armed: tuple[str, int] | None = None
        self._restore: list[tuple[type, str, Any]] = []
        for cls, name in candidate_methods():
            original = vars(cls)[name]
            qualified = f"{cls.__name__}.{name}"
            if cls is run_module.Run and hasattr(original, "__wrapped__"):  # an event entry: inject into its body
                replacement = run_module._own_time(self._wrap(qualified, original.__wrapped__))
            else:
                replacement = self._wrap(qualified, original)
            self._restore.append((cls, name, original))
            setattr(cls, name, replacement)

    def _wrap(self, qualified: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def injected(*args: Any, **kwargs: Any) -> Any:
            if self.during():
                if qualified not in self.seen:
                    self.seen.append(qualified)
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

    def next(self, seen: list[str], nan_step: bool) -> str | None:
        for name in seen:
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
