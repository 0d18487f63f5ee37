"""Fault injection into every method the plugin runs during a training step, found by introspection.

:func:`candidate_methods` lists every function defined on :class:`~lightning_debug.run.Run`, on
:class:`~lightning_debug.core.monitor.Monitor` and on every subclass of it in the package (no hand-written
list). :class:`Injector` wraps each of them on one rank: every call is noted with its step (so the methods that
run during a step are those called between the run's start and its end, and the kinds of step each runs at are
known), and at most one armed method raises once per step. :class:`Schedule` picks it; :func:`coverage` says
what the injections reached.

Left out, found by introspection too: the Run's event entries (:func:`event_entries`, the methods wrapped by
``run._own_time`` that an adapter calls: ``batch_start``, ``before_optimizer_step``, ...). They are the gate
itself: each guards its body, and ``before_optimizer_step`` and ``batch_end`` make the step's collectives
there, after the guarded work. Every method they call is injected.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import Counter
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
    """Wraps every candidate method: notes at which steps each is called, raises once in an armed one.

    ``during`` tells whether training is between its start and its end. ``arm(wanted, step)`` opens the window of
    ``step`` (from just before it starts to just after its batch end): the first call in it of a method for which
    ``wanted(name)`` is true raises, once. Calls are noted against the window's step (a batch end runs after the
    optimizer step has counted the step).
    """

    def __init__(self, during: Callable[[], bool]) -> None:
        self.during = during
        self.seen: list[str] = []  # in the order first called during a step
        self.calls: dict[str, list[int]] = {}  # method -> the steps it was called at, in order
        self.fired: list[tuple[str, int]] = []
        self.step = -1
        self.armed: Callable[[str], bool] | None = None
        self._restore: list[tuple[type, str, Any]] = []
        for cls, name in candidate_methods():
            original = vars(cls)[name]
            self._restore.append((cls, name, original))
            setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", original))

    def _wrap(self, qualified: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def injected(*args: Any, **kwargs: Any) -> Any:
            if self.during():
                steps = self.calls.get(qualified)
                if steps is None:
                    self.seen.append(qualified)
                    steps = self.calls[qualified] = []
                if not steps or steps[-1] != self.step:
                    steps.append(self.step)
                armed = self.armed
                if armed is not None and armed(qualified):
                    self.armed = None
                    self.fired.append((qualified, self.step))
                    raise RuntimeError(f"{PLANTED} {qualified} at step {self.step}")
            return function(*args, **kwargs)

        injected.__name__ = getattr(function, "__name__", "injected")
        injected.__wrapped__ = function  # type: ignore[attr-defined]
        return injected

    def arm(self, wanted: Callable[[str], bool] | None, step: int) -> None:
        self.armed, self.step = wanted, step

    def remove(self) -> None:
        for cls, name, original in reversed(self._restore):
            setattr(cls, name, original)


class Schedule:
    """Which method to arm at each step, so that every method called during a step fails once at each kind of step
    (NaN, healthy) it is called at, one injection per step.

    A method is armed at a step where it is expected: its usual interval after one of its last calls (the step
    after, or an ``epoch_start`` at the next epoch's first step), or a step listed for it in ``hints``. Of the
    expected methods, one already called at a step of this kind goes first, the rarest first (it has the fewest
    chances), then the one first seen last (a callee before its caller, whose failure can keep the callee from
    running for good: a ``GradientMonitor._on_numerics`` that raises before its check step is marked arrived
    holds back every later ``_complete``). A method called for the first time in the fit fails at once, before
    the armed one (a method called at one step only, such as the event of the first NaN step). When none is
    expected, or at the first step, the first call of any method not yet failed at this kind of step fires. A
    method armed ``tries`` times without being called is left; :func:`coverage` says at the end, from the steps
    each method was called at, which (method, kind) pairs were applicable and which were reached. With
    ``targets``, only those pairs are armed, and ``hints`` gives the steps at which an earlier fit called each
    (a second fit for what the first one left, :func:`leftovers`).
    """

    def __init__(self, tries: int = 4, targets: set[tuple[str, bool]] | None = None,
                 hints: dict[tuple[str, bool], set[int]] | None = None) -> None:
        self.tries, self.targets, self.hints = tries, targets, hints or {}
        self.fired: set[tuple[str, bool]] = set()
        self.attempts: dict[tuple[str, bool], int] = {}
        self.kinds: dict[int, bool] = {}  # step -> whether it was a NaN step

    def next(self, step: int, nan: bool, calls: dict[str, list[int]]) -> Callable[[str], bool]:
        """What to arm at ``step`` (of kind ``nan``): a method not called yet in this fit, else one expected
        method, or any method not yet failed at this kind of step."""
        self.kinds[step] = nan
        known = set(calls)
        order = list(calls) + sorted({name for name, kind in self.hints if kind == nan} - known)
        expected = [name for name in order if self.wanted(name, nan) and self.attempts.get((name, nan), 0) < self.tries
                    and (step in self.hints.get((name, nan), ()) or name in known and _expected(calls[name], step))]

        def new(called: str) -> bool:
            return called not in known and self.wanted(called, nan)

        if expected:
            def kind_unseen(name: str) -> bool:
                return step not in self.hints.get((name, nan), ()) and not any(
                    self.kinds.get(at) == nan for at in reversed(calls.get(name, [])))

            name = min(expected, key=lambda n: (kind_unseen(n), len(calls.get(n, [])), -order.index(n)))
            self.attempts[(name, nan)] = self.attempts.get((name, nan), 0) + 1
            return lambda called: called == name or new(called)
        return lambda called: self.wanted(called, nan)

    def wanted(self, name: str, nan: bool) -> bool:
        """Not yet failed at this kind of step, and among the targets if there are some."""
        return (name, nan) not in self.fired and (self.targets is None or (name, nan) in self.targets)

    def result(self, fired: list[tuple[str, int]], step: int, nan: bool) -> None:
        self.fired.update((name, nan) for name, at in fired if at == step)

    def finished(self, seen: list[str], nan: bool) -> bool:
        """Every method seen or hinted is fired at this kind of step, or its tries are used up."""
        names = set(seen) | {name for (name, kind), steps in self.hints.items() if kind == nan and steps}
        return all(not self.wanted(name, nan) or self.attempts.get((name, nan), 0) >= self.tries for name in names)


def _expected(steps: list[int], step: int) -> bool:
    """Whether a method called at ``steps`` should be called at ``step``: one usual interval (the most common
    one between its calls, 1 when it was called once) after one of its last calls."""
    gaps = Counter(b - a for a, b in zip(steps, steps[1:]))
    gap = max(gaps, key=lambda g: (gaps[g], g)) if gaps else 1
    return any(step - at == gap for at in steps[-3:])


def coverage(passes: list[tuple[dict[str, list[int]], list[tuple[str, int]], set[int]]]) -> dict[str, Any]:
    """Per kind of step (``healthy``, ``nan``), over one or more fits (``calls``, ``fired``, ``nan_steps``): the
    methods called at a step of that kind (applicable), those injected there, and those applicable but never
    injected (not reached). A method never called at a step of a kind is not applicable there
    (``AnomalyMonitor.undo_step`` at a healthy step: it runs on dropped steps only)."""
    methods = sorted({name for calls, _, _ in passes for name in calls})
    result: dict[str, Any] = {"methods": len(methods)}
    for label, nan in (("healthy", False), ("nan", True)):
        applicable = {name for calls, _, nans in passes for name, steps in calls.items()
                      if any((at in nans) == nan for at in steps)}
        injected = {name for _, fired, nans in passes for name, at in fired if (at in nans) == nan}
        result[label] = {"applicable": len(applicable), "injected": len(injected & applicable),
                         "not_applicable": sorted(set(methods) - applicable),
                         "not_reached": sorted(applicable - injected)}
    return result


def leftovers(result: dict[str, Any], passes: list[tuple[dict[str, list[int]], list[tuple[str, int]], set[int]]]
              | None = None) -> list[tuple[str, bool, list[int]]]:
    """The (method, at a NaN step) pairs a fit left: not reached, or not applicable (a method an earlier injection
    kept from running again), each with the steps of that kind at which ``passes`` called it: the targets of a
    second fit, and where to expect them."""
    left = []
    for label, nan in (("healthy", False), ("nan", True)):
        for name in result[label]["not_reached"] + result[label]["not_applicable"]:
            steps = sorted({at for calls, _, nans in passes or [] for at in calls.get(name, []) if (at in nans) == nan})
            left.append((name, nan, steps))
    return left


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
