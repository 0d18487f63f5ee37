"""The registry of rules: a rule module says which kinds it makes and at which moment it runs, and its area's
monitor runs it there on one *facts* object (docs/architecture.md, "A check is a rule"). An area package imports its
rule modules itself (:func:`import_rules`), so a new rule module needs no import edit anywhere.
    >>> from lightning_debug.core.findings import Finding
    >>> from lightning_debug.core.kinds import Kind, Severity
    >>> def judge(facts: FitStart) -> Finding:
    ...     return Finding(Kind.WEIGHT_DECAY_ON_NORM, Severity.INFO, "decayed")
    >>> with registered(judge, Kind.WEIGHT_DECAY_ON_NORM, at=Moment.FIT_START) as added:
    ...     added in rules_for(Area.GRADIENTS, Moment.FIT_START), added.area.value
    (True, 'gradients')
    >>> added in rules_for(Area.GRADIENTS, Moment.FIT_START)
    False
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lightning_debug.config import Area
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import KIND_SPECS, Kind
from lightning_debug.core.strenum import StrEnum
from lightning_debug.core.verdicts import VerdictEngine


class Moment(StrEnum):
    """When a rule runs, and so which facts it is given."""

    FIT_START = "fit_start"
    """Training starts at step 0 or resumes: :class:`FitStart`."""
    CHECK_STEP = "check_step"
    """A check step of the area, before its optimizer step (no device work): :class:`CheckStep`."""
    CHECK_READ = "check_read"
    """A check step's numbers are on the host (read back without a sync): :class:`CheckRead`."""
    MODULE_WALK = "module_walk"
    """The module tree at fit start, at each epoch's start and at the end of the run: :class:`ModuleWalk`."""


@dataclass(frozen=True)
class FitStart:
    """What a run knows before any tensor work; ``parameters``: (name, parameter, owning module or None), in
    registration order; ``total_steps``: None when unknown."""

    step: int
    module: Any = None
    parameters: Sequence[tuple[str, Any, Any]] = ()
    param_groups: Sequence[Mapping[str, Any]] = ()
    total_steps: int | None = None
    schedulers: Sequence[str] = ()
    start_lrs: Sequence[Any] = ()
    verdicts: VerdictEngine = field(default_factory=VerdictEngine)
    settings: Any = None


@dataclass(frozen=True)
class CheckStep:
    """A check step before its optimizer step: the optimizers' groups as they are now and the schedule; ``loss``:
    the last loss read back (an earlier check step's: this one's is not on the host yet), ``first_loss`` the run's
    first (NaN: not known)."""

    step: int
    param_groups: Sequence[Mapping[str, Any]] = ()
    start_lrs: Sequence[Any] = ()
    total_steps: int | None = None
    schedulers: Sequence[str] = ()
    verdicts: VerdictEngine = field(default_factory=VerdictEngine)
    settings: Any = None
    loss: float = float("nan")
    first_loss: float = float("nan")


@dataclass(frozen=True)
class CheckRead:
    """A check step whose numbers reached the host: ``numbers`` is the area's reading (``HostNumerics``, a
    ``MemoryReading``), ``drift`` what it measured across check steps (None: not this time), ``history`` the area's
    bounded run history."""

    step: int
    numbers: Any = None
    where: Mapping[str, Any] = field(default_factory=dict)
    loss: float = float("nan")
    first_loss: float | None = None
    drift: Any = None
    param_groups: Sequence[Mapping[str, Any]] = ()
    start_lrs: Sequence[Any] = ()
    total_steps: int | None = None
    history: Any = None
    verdicts: VerdictEngine = field(default_factory=VerdictEngine)
    settings: Any = None
    units: Any = None
    """How alike the units of each parameter are (``symmetric_units``; None: not read this step)."""
    clipping: tuple[float, str] | None = None
    """The clipping applied after the checks read the gradients: ``(value, "norm" | "value")`` (None: none)."""


@dataclass(frozen=True)
class ModuleWalk:
    """The model (never None: without one nothing is walked) at optimizer step ``step``."""

    step: int
    module: Any
    settings: Any = None


Facts = FitStart | CheckStep | CheckRead | ModuleWalk


@dataclass
class Recorded:
    """A finding that opens or continues an episode of ``key`` at each of ``steps`` (empty: the step judged);
    ``flagged``: the names it counts (report.json's ``most_flagged``)."""

    finding: Finding
    flagged: list[str] = field(default_factory=list)
    key: str = ""
    steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    """One registered rule; with ``suspects`` its suspicions go to the engine, every time it runs (so a hold not
    suspected again ends)."""

    judge: Callable[[Any], Any]
    kinds: tuple[Kind, ...]
    moment: Moment
    area: Area
    suspects: bool = False

    @property
    def name(self) -> str:
        return f"{self.judge.__module__}.{self.judge.__qualname__}"


_RULES: list[Rule] = []

Judge = TypeVar("Judge", bound=Callable[..., Any])


def area_of(kinds: Sequence[Kind]) -> Area:
    """The one area of ``kinds`` (their ``KindSpec.area``); ValueError when they are of several or none."""
    areas = {KIND_SPECS[kind].area for kind in kinds}
    if len(areas) != 1:
        raise ValueError(f"a rule makes kinds of one area, got {sorted(kind.value for kind in kinds)} "
                         f"({sorted(area.value for area in areas)})")
    return areas.pop()


def make_rule(judge: Callable[[Any], Any], *kinds: Kind, at: Moment, suspects: bool = False) -> Rule:
    return Rule(judge, tuple(kinds), Moment(at), area_of(kinds), suspects)


def rule(*kinds: Kind, at: Moment, suspects: bool = False) -> Callable[[Judge], Judge]:
    """Register the decorated function as the rule that makes ``kinds`` at ``at``; it is returned unchanged, so it
    stays callable (and tested) as a plain function."""
    area_of(kinds)

    def register(judge: Judge) -> Judge:
        add(make_rule(judge, *kinds, at=at, suspects=suspects))
        return judge
    return register


def add(new: Rule) -> Rule:
    """Register ``new`` (a rule registered again under the same name replaces itself: a module reloaded)."""
    _RULES[:] = [known for known in _RULES if known.name != new.name or known.moment is not new.moment] + [new]
    return new


def remove(known: Rule) -> None:
    if known in _RULES:
        _RULES.remove(known)


@contextmanager
def registered(judge: Callable[[Any], Any], *kinds: Kind, at: Moment, suspects: bool = False) -> Iterator[Rule]:
    """``judge`` registered for the duration of a ``with`` block (tests)."""
    added = add(make_rule(judge, *kinds, at=at, suspects=suspects))
    try:
        yield added
    finally:
        remove(added)


def rules_for(area: Area, moment: Moment) -> tuple[Rule, ...]:
    """The rules of ``area`` at ``moment``, in the order they were registered."""
    return tuple(known for known in _RULES if known.area is area and known.moment is moment)


def all_rules() -> tuple[Rule, ...]:
    return tuple(_RULES)


def import_rules(package: str, path: Iterable[str]) -> list[str]:
    """Import every module of ``package`` (``path``: its ``__path__``), so each registers its rules."""
    names = [f"{package}.{info.name}" for info in pkgutil.iter_modules(list(path)) if not info.ispkg]
    for name in names:
        importlib.import_module(name)
    return names


__all__ = ["CheckRead", "CheckStep", "Facts", "FitStart", "ModuleWalk", "Moment", "Recorded", "Rule", "add", "all_rules",
           "area_of", "import_rules", "registered", "remove", "rule", "rules_for"]
