"""One lifecycle for every finding that needs more than one observation: suspect, hold, confirm, label, end
(docs/architecture.md, "Suspect, hold, confirm"). An invariant no policy overrides: a suspicion whose value is not
finite is confirmed at once.

Example::

    >>> from lightning_debug.core.kinds import Kind
    >>> engine = VerdictEngine()
    >>> [engine.observe(Kind.VANISHING_GRAD, step, [Suspicion(Kind.VANISHING_GRAD, "fc1", step)])
    ...  for step in (0, 1)]
    [[], []]
    >>> confirmed = engine.observe(Kind.VANISHING_GRAD, 2, [Suspicion(Kind.VANISHING_GRAD, "fc1", 2)])
    >>> [(c.key, c.steps, c.by.value) for c in confirmed]
    [('fc1', [0, 1, 2], 'persisted')]
    >>> engine.observe(Kind.VANISHING_GRAD, 3, []), engine.held_keys(Kind.VANISHING_GRAD)
    ([], [])
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import KIND_SPECS, AtEnd, Confirm, Kind, Severity, Until
from lightning_debug.core.strenum import StrEnum


class ConfirmedBy(StrEnum):
    """Why a suspicion became a finding."""

    AT_ONCE = "at_once"
    PERSISTED = "persisted"
    FOLLOW_UP = "follow_up"
    NOT_FINITE = "not_finite"
    AT_END = "at_end"
    UNCONFIRMED = "unconfirmed"
    """It ended unconfirmed and is reported as the policy's ``else_kind``."""
    AGAIN = "again"
    """A key confirmed earlier is still suspect on a later observation."""
    BACK_UNDER = "back_under"
    """The condition ended with a reading back at or under its bound (policies with ``until``)."""


@dataclass
class Suspicion:
    """What a rule saw on one observation: ``kind`` may be wrong for ``key`` at ``step``.

    ``value``: the measurement (a non-finite one confirms at once); ``bound``: what later readings must stay above
    (``follow_up``); ``variant`` picks a patience of the policy's ``variants``; ``at_least``: a longer hold the run's
    history asks for; ``record``: False between check steps (it counts toward the hold, but is no step the finding is
    recorded at); ``measured``: plain values that travel in the checkpoint; ``confirms``: False when a condition of the
    rule's own is not met (it keeps the hold going but neither confirms it nor is reported again); ``lasting``: steps
    from the hold's first observation that a persisting suspicion must also span, where how long a condition lasts
    tells it from a healthy look-alike (``learning_stalled``: a learning rate at 0 in effect for a stretch of the run,
    not for the few steps around a warm restart)::

        >>> from lightning_debug.core.kinds import Kind
        >>> engine = VerdictEngine()
        >>> stall = lambda step: Suspicion(Kind.LEARNING_STALLED, "lr_zero", step, variant="lr_zero", lasting=60)
        >>> [bool(engine.observe(Kind.LEARNING_STALLED, step, [stall(step)])) for step in (10, 11, 12, 70)]
        [False, False, False, True]
    """

    kind: Kind
    key: str
    step: int
    finding: Finding | None = None
    flagged: list[str] = field(default_factory=list)
    where: dict[str, Any] | None = None
    value: float | None = None
    bound: float | None = None
    variant: str = ""
    scope: str = ""
    at_least: int = 0
    record: bool = True
    measured: dict[str, Any] = field(default_factory=dict)
    confirms: bool = True
    lasting: int = 0

    def state_dict(self) -> dict[str, Any]:
        finding = self.finding
        return dict(vars(self), kind=self.kind.value, flagged=list(self.flagged), measured=dict(self.measured),
                    finding=None if finding is None else {"kind": finding.kind.value, "severity": finding.severity.value,
                                                          "message": finding.message, "details": finding.details})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Suspicion":
        entry = state.get("finding")
        finding = None if entry is None else Finding(Kind(entry["kind"]), Severity(entry["severity"]),
                                                     entry["message"], dict(entry["details"]))
        known = {name: state[name] for name in (f.name for f in fields(cls)) if name in state}
        return cls(**dict(known, kind=Kind(state["kind"]), step=int(state["step"]), finding=finding,
                          flagged=list(state["flagged"]), measured=dict(state.get("measured", {}))))


@dataclass
class Confirmed:
    """A suspicion that became a finding: record it at each of ``steps`` (oldest first), as ``kind``; ``first``
    opened the hold, ``latest`` confirmed it."""

    kind: Kind
    first: Suspicion
    latest: Suspicion
    steps: list[int]
    by: ConfirmedBy
    readings: int = 0
    streak: int = 1

    @property
    def key(self) -> str:
        return self.latest.key


@dataclass
class Hold:
    """One held key; ``above``/``below``: readings after it over and under its bound; once ``confirmed``, further
    suspicions are reported as they come."""

    first: Suspicion
    latest: Suspicion
    steps: list[int]
    streak: int = 1
    above: int = 0
    below: int = 0
    confirmed: bool = False

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self), first=self.first.state_dict(), latest=self.latest.state_dict(), steps=list(self.steps))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Hold":
        return cls(**dict(state, first=Suspicion.from_state(state["first"]), latest=Suspicion.from_state(state["latest"]),
                          steps=[int(step) for step in state["steps"]]))


def policy_of(kind: Kind) -> Confirm:
    """The confirmation policy of ``kind`` (its row of the table of kinds)."""
    return KIND_SPECS[kind].confirm


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class VerdictEngine:
    """Every held suspicion of a monitor; :meth:`observe` takes one observation of a kind, :meth:`flush` ends the
    run. Bounded: ``max_held`` suspicions per kind and scope, a held key keeps at most its patience's steps.

        >>> from lightning_debug.core.kinds import Kind
        >>> engine = VerdictEngine()
        >>> jump = Suspicion(Kind.EXPLODING_GRAD, "4", 4, value=50.0, bound=10.0)
        >>> engine.observe(Kind.EXPLODING_GRAD, 4, [jump]), engine.observe(Kind.EXPLODING_GRAD, 5, reading=40.0)
        ([], [])
        >>> [(c.steps, c.by.value) for c in engine.observe(Kind.EXPLODING_GRAD, 6, reading=60.0)]
        [([4], 'follow_up')]
        >>> nan = Suspicion(Kind.EXPLODING_GRAD, "9", 9, value=math.inf, bound=10.0)
        >>> [(c.steps, c.by.value) for c in engine.observe(Kind.EXPLODING_GRAD, 9, [nan])]
        [([9], 'not_finite')]

    ``until`` holds a suspicion while it is suspected again; the reading that ends it decides (``slow_step``: a run
    back under the threshold of before is a burst, one that ends above it a new level, the policy's ``else_kind``)::

        >>> run = lambda step: Suspicion(Kind.SLOW_STEP, "run", step, bound=50.0, measured={"steps": step - 9})
        >>> [engine.observe(Kind.SLOW_STEP, step, [run(step)]) for step in (10, 11)]
        [[], []]
        >>> engine.latest(Kind.SLOW_STEP, "run").measured
        {'steps': 2}
        >>> [(c.kind.value, c.first.step, c.by.value) for c in engine.observe(Kind.SLOW_STEP, 12, reading=20.0)]
        [('slow_step', 10, 'back_under')]

    ``confirms=False`` keeps a hold going without confirming it (``loss_divergence``: 4 checks in a row, confirmed
    only on a check where the level is higher than 3 checks before)::

        >>> climb = lambda step: Suspicion(Kind.LOSS_DIVERGENCE, "climb", step, confirms=step == 14)
        >>> [[c.streak for c in engine.observe(Kind.LOSS_DIVERGENCE, step, [climb(step)])] for step in range(10, 15)]
        [[], [], [], [], [5]]
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, str, str], Hold] = {}
        self._last_recorded: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def held_keys(self, kind: Kind, scope: str = "") -> list[str]:
        """The keys of ``kind`` held in ``scope``, oldest first."""
        return [key for (k, s, key), _ in self._ordered() if k == kind.value and s == scope]

    def hold(self, kind: Kind, key: str, scope: str = "") -> Hold | None:
        """``key``'s hold (None: not held); for reading only."""
        return self._held.get((kind.value, scope, key))

    def holds(self, kind: Kind, scope: str = "") -> dict[str, Hold]:
        """Every hold of ``kind`` in ``scope`` by key, oldest first; for reading only."""
        return {key: held for (k, s, key), held in self._ordered() if k == kind.value and s == scope}

    def latest(self, kind: Kind, key: str, scope: str = "") -> Suspicion | None:
        """The latest suspicion held for ``key`` (what the rule measured so far), or None."""
        held = self._held.get((kind.value, scope, key))
        return None if held is None else held.latest

    def holding(self, kind: Kind, scope: str | None = None) -> bool:
        """Whether a suspicion of ``kind`` (in ``scope``, or any) waits for readings or more observations."""
        return any(k == kind.value and (scope is None or s == scope) and not held.confirmed
                   for (k, s, _), held in self._held.items())

    def observe(self, kind: Kind, step: int, suspicions: Iterable[Suspicion] = (), *, scope: str = "",
                judged: Collection[str] | None = None, reading: float | None = None) -> list[Confirmed]:
        """One observation of ``kind`` in ``scope`` at ``step``; returns what it confirms, in step order.

        ``judged``: the keys looked at (None: all); a held key judged and not suspected again ends. ``reading``: what
        the suspicions held before ``step`` compare with their bound (``follow_up``).
        """
        policy = policy_of(kind)
        suspicions = list(suspicions)
        suspected = {s.key for s in suspicions}
        confirmed: list[Confirmed] = []
        for held_key, held in self._ordered():
            if held_key[0] != kind.value or held_key[1] != scope or held.first.step >= step:
                continue
            key = held_key[2]
            if key in suspected or (judged is not None and key not in judged):
                continue
            confirmed += self._follow(held_key, held, policy, reading)
        for suspicion in suspicions:
            confirmed += self._suspect(suspicion, policy, scope)
        return self._label(confirmed)

    def end(self, kind: Kind, keys: Iterable[str], scope: str = "") -> list[Confirmed]:
        """``keys`` are known not to be suspect any more (a parameter got its gradient): their holds end,
        dismissed or as the policy's ``else_kind``, whatever step it is."""
        ended: list[Confirmed] = []
        for key in keys:
            held = self._held.get((kind.value, scope, key))
            if held is not None:
                ended += self._follow((kind.value, scope, key), held, policy_of(kind), None)
        return self._label(ended)

    def flush(self, kinds: Collection[Kind] | None = None) -> list[Confirmed]:
        """The end of the run: decide every suspicion still held (of ``kinds``, or all) by its policy."""
        decided: list[Confirmed] = []
        for held_key, held in self._ordered():
            if kinds is not None and Kind(held_key[0]) not in kinds:
                continue
            del self._held[held_key]
            if not held.confirmed:
                decided += self._at_end(held, policy_of(Kind(held_key[0])))
        return self._label(decided)

    # --- the lifecycle --------------------------------------------------------------------------
    def _ordered(self) -> list[tuple[tuple[str, str, str], Hold]]:
        return sorted(self._held.items(), key=lambda item: (item[1].first.step, item[0]))

    def _suspect(self, suspicion: Suspicion, policy: Confirm, scope: str) -> list[Confirmed]:
        suspicion.scope = scope
        held_key = (suspicion.kind.value, scope, suspicion.key)
        held = self._held.get(held_key)
        decided: list[Confirmed] = []
        late = False
        if held is None:
            decided += self._make_room(suspicion.kind, scope, policy)
            held = self._held[held_key] = Hold(suspicion, suspicion, [suspicion.step] if suspicion.record else [])
        else:
            late = held.latest.step >= suspicion.step  # observed already (looked at between checks, or read back late)
            if late and (not suspicion.record or suspicion.step in held.steps):
                return decided
            if not late:
                held.latest = suspicion
                held.streak += 1
            if suspicion.record:
                kept = max(policy.needed(suspicion.variant) or 1, suspicion.at_least, 1)
                held.steps = sorted(held.steps + [suspicion.step])[-kept:]
        if held.confirmed:
            return decided + ([Confirmed(suspicion.kind, held.first, suspicion, [suspicion.step], ConfirmedBy.AGAIN,
                                         streak=held.streak)] if suspicion.record and suspicion.confirms else [])
        if late:
            return decided
        needed = policy.needed(suspicion.variant)
        if not _finite(suspicion.value):
            by = ConfirmedBy.NOT_FINITE
        elif not suspicion.confirms:
            return decided
        elif (needed is not None and max(needed, suspicion.at_least) > 1
              and held.streak >= max(needed, suspicion.at_least)
              and suspicion.step - held.first.step >= suspicion.lasting):
            by = ConfirmedBy.PERSISTED
        elif not policy.holds or (needed == 1 and suspicion.at_least <= 1):  # a variant of 1 is its own proof
            by = ConfirmedBy.AT_ONCE
        else:
            return decided
        if needed is None:
            del self._held[held_key]  # confirmed by its own readings or at once: nothing persists
        else:
            held.confirmed = True
        steps = (held.steps or [suspicion.step]) if by is ConfirmedBy.PERSISTED and policy.backdate else [suspicion.step]
        return decided + [Confirmed(suspicion.kind, held.first, suspicion, list(steps), by, streak=held.streak)]

    def _follow(self, held_key: tuple[str, str, str], held: Hold, policy: Confirm,
                reading: float | None) -> list[Confirmed]:
        """A held key judged without being suspected again: its readings confirm it, or its hold ends."""
        kind = Kind(held_key[0])
        if policy.until is Until.BACK_UNDER and not held.confirmed:
            del self._held[held_key]
            bound = held.latest.bound
            if reading is not None and math.isfinite(reading) and (bound is None or reading <= bound):
                return [Confirmed(kind, held.first, held.latest, [held.latest.step], ConfirmedBy.BACK_UNDER)]
            if policy.else_kind is None:
                return []
            return [Confirmed(policy.else_kind, held.first, held.latest, [held.first.step], ConfirmedBy.UNCONFIRMED)]
        if policy.follow_up and reading is not None and not held.confirmed:
            bound = held.latest.bound
            if not _finite(reading) or (bound is not None and reading > bound):
                held.above += 1
                if held.above < policy.follow_up and _finite(reading):
                    return []  # a reading that is not finite confirms at once: nothing healthy falls back into it
                del self._held[held_key]
                by = ConfirmedBy.FOLLOW_UP if _finite(reading) else ConfirmedBy.NOT_FINITE
                return [Confirmed(kind, held.first, held.latest, [held.first.step], by, held.above)]
            held.below += 1
        del self._held[held_key]
        if held.confirmed or policy.else_kind is None:
            return []
        return [Confirmed(policy.else_kind, held.first, held.latest, [held.first.step], ConfirmedBy.UNCONFIRMED)]

    def _at_end(self, held: Hold, policy: Confirm) -> list[Confirmed]:
        kind, end = held.first.kind, policy.at_end
        if ((end is AtEnd.REPORT and held.streak >= held.latest.at_least)
                or (end is AtEnd.IF_FOLLOWED and held.above and not held.below)):
            steps = ([held.first.step] if policy.follow_up or policy.until
                     else list(held.steps) or [held.latest.step])
            return [Confirmed(kind, held.first, held.latest, steps, ConfirmedBy.AT_END, held.above, held.streak)]
        if end is AtEnd.ELSE_KIND and policy.else_kind is not None:
            return [Confirmed(policy.else_kind, held.first, held.latest, [held.first.step], ConfirmedBy.UNCONFIRMED)]
        return []

    def _make_room(self, kind: Kind, scope: str, policy: Confirm) -> list[Confirmed]:
        mine = [(held_key, held) for held_key, held in self._ordered()
                if held_key[0] == kind.value and held_key[1] == scope]
        decided: list[Confirmed] = []
        while len(mine) >= policy.max_held:
            held_key, held = mine.pop(0)
            del self._held[held_key]
            if not held.confirmed:
                decided += self._at_end(held, policy)
        return decided

    def _label(self, confirmed: list[Confirmed]) -> list[Confirmed]:
        """Backdated steps already recorded for the kind (by another key's confirmation) are not counted again."""
        for item in sorted(confirmed, key=lambda c: c.steps[0]):
            last = self._last_recorded.get(item.kind.value, -1)
            if item.by is ConfirmedBy.PERSISTED:
                item.steps = [step for step in item.steps if step > last] or item.steps[-1:]
            self._last_recorded[item.kind.value] = max([last, *item.steps])
        return sorted(confirmed, key=lambda c: c.steps[0])

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"held": [held.state_dict() for _, held in self._ordered()],
                "last_recorded": dict(self._last_recorded)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._held = {}
        for entry in state.get("held", []):
            held = Hold.from_state(entry)
            self._held[(held.first.kind.value, held.first.scope, held.first.key)] = held
        self._last_recorded = {kind: int(step) for kind, step in state.get("last_recorded", {}).items()}
