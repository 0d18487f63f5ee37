"""The protocol every area's checks implement, and what they share: findings, episodes, warnings.

A monitor never sees Lightning or Accelerate: the run calls the same events (:class:`Event`) with a
:class:`~lightning_debug.core.context.RunContext` the adapter filled in, so each check has one implementation.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.context import HistogramWriter as HistogramWriter  # re-exported
from lightning_debug.core.context import Replay as Replay  # re-exported
from lightning_debug.core.context import RunContext
from lightning_debug.core.findings import EpisodePhase, Episodes, Finding, Tally
from lightning_debug.core.guard import notify
from lightning_debug.core.kinds import Kind, Severity, kinds_of
from lightning_debug.core.ledger import CheckSchedule, RunLedger
from lightning_debug.core.session import Session, Where
from lightning_debug.core.numerics import NumericsQueue, StepNumerics
from lightning_debug.core.rules import Facts, Moment, Recorded, Rule, rules_for
from lightning_debug.core.verdicts import Confirmed, Suspicion, VerdictEngine

NumericsSource = Callable[[], StepNumerics]


class Event(enum.Enum):
    """The moments of a training loop a monitor can ask to be called at."""

    START = "start"
    EPOCH_START = "epoch_start"
    BATCH_START = "batch_start"
    BEFORE_BACKWARD = "before_backward"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    EVALUATION = "evaluation"
    EXCEPTION = "exception"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash runs Python code on every lookup


GATED_EVENTS = frozenset({Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END})
"""The events the run can skip on a monitor's other steps (their first argument is the optimizer step)."""


class Decision(enum.IntEnum):
    """What the run does with the optimizer step being checked; the largest one wins."""

    CONTINUE = 0
    SKIP = 1
    STOP = 2


class Monitor:
    """Base of the four areas: findings with episodes and tallies, rate-limited warnings, scalars, resume.
    Subclasses set ``area`` and the ``events`` they need and override those methods; their ``kinds`` come from the
    table of kinds, and the rules registered for their area run through :meth:`run_rules`."""

    area: ClassVar[Area]
    kinds: ClassVar[frozenset[Kind]] = frozenset()
    """The kinds whose episodes this monitor closes (:func:`~lightning_debug.core.kinds.kinds_of` its area)."""
    events: frozenset[Event] = frozenset()
    """The events the run calls this monitor at (an instance may narrow them before it joins a run)."""
    due_events: frozenset[Event] = frozenset()
    """Those of ``events`` needed on check steps only: the run skips them on other steps, which then cost nothing."""
    frequency_of: ClassVar[Callable[[DebugConfig], int] | None] = None
    """Reads this monitor's check frequency from a config (its row of ``monitors.areas.AREA_SPECS``)."""
    measures: bool = False
    """Whether its ``before_optimizer_step`` reads the step's shared measurement: the run makes it first."""
    decides: bool = False
    """Whether its ``before_optimizer_step`` may return other than CONTINUE (or raise): the ranks then agree."""
    plan_collectives: Callable[[Any], list[Any]] | None = None
    """The collectives it makes after the step's measurement, in order, from values every rank shares: the gate
    makes those a failure kept this rank from reaching."""
    batch_end_collectives: Callable[[int, bool], list[Any]] | None = None
    """The same for ``batch_end``: a function of the step and whether the batch took an optimizer step."""
    max_warnings: ClassVar[int] = 10
    episode_grace: ClassVar[int] = 3
    max_episode_events: ClassVar[int] = 25

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "area" in cls.__dict__:
            cls.kinds = kinds_of(cls.area)

    def __init__(self, config: DebugConfig, source: str, frequency: int | None = None) -> None:
        self.config = config
        self.source = source
        if frequency is None:
            if self.frequency_of is None:
                raise TypeError(f"{type(self).__name__} has no row in the table of areas "
                                "(lightning_debug.monitors.areas) to read its check frequency from; pass frequency=")
            frequency = self.frequency_of(config)
        self.frequency = frequency
        self.schedule = CheckSchedule(self.frequency)
        self.tally = Tally()
        self.episodes = Episodes(grace=self.episode_grace)
        self.verdicts = VerdictEngine()
        self._silenced_episodes: set[tuple[str, str]] = set()
        self._summarized: dict[str, int] = {}
        self._seen_this_check: set[tuple[str, str]] = set()
        self._warnings_left = self.max_warnings
        self._session: Session | None = None
        self._context: RunContext | None = None
        self._numerics: NumericsQueue | None = None
        self._ledger: RunLedger | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _session=None, _context=None, _numerics=None, _ledger=None)

    # --- binding --------------------------------------------------------------------------------
    def bind(self, session: Session, context: RunContext, numerics: NumericsQueue) -> None:
        self._session, self._context, self._numerics = session, context, numerics

    def share(self, ledger: RunLedger) -> None:
        """The run's ledger, where monitors leave facts for each other."""
        self._ledger = ledger

    def unbind(self) -> None:
        self._session = self._context = self._numerics = None
        self._ledger = None

    @property
    def bound(self) -> bool:
        return self._session is not None

    def _bound_to(self, value: Any) -> Any:
        if value is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a running training loop")
        return value

    @property
    def session(self) -> Session:
        return self._bound_to(self._session)

    @property
    def context(self) -> RunContext:
        return self._bound_to(self._context)

    @property
    def ledger(self) -> RunLedger:
        return self._bound_to(self._ledger)

    @property
    def numerics(self) -> NumericsQueue:
        return self._bound_to(self._numerics)

    def due(self, step: int) -> bool:
        return self.schedule.is_due(step)

    def optimizer_step_due(self, step: int) -> bool:
        """Whether a check of one optimizer step runs at ``step``: with several optimizers the frequency counts the
        steps of the one being stepped, so each is checked every ``frequency`` of its own steps."""
        return self.schedule.is_due(self.numerics.scheduled_step(step))

    # --- events (the run calls those listed in ``events``) ---------------------------------------
    def start(self, step: int) -> None:
        """Training starts (or resumes) at optimizer step ``step``."""

    def epoch_start(self, step: int) -> None:
        """A training epoch starts."""

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        """A micro-batch of optimizer step ``step`` starts; ``captured`` is what a replay needs."""

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        """A micro-batch's loss is computed."""

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        """Gradients are final, the optimizer has not stepped; ``numerics()`` is the shared gradient pass."""
        return Decision.CONTINUE

    def after_optimizer_step(self, steps_done: int) -> None:
        """``steps_done`` optimizer steps have been taken (called after every micro-batch)."""

    def batch_end(self, step: int, batch: Any) -> None:
        """A micro-batch of optimizer step ``step`` ends."""

    def evaluation(self, step: int, started: bool) -> None:
        """Evaluation (validation) between training steps starts or ends."""

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        """The training loop raised ``error`` (which propagates unchanged after this)."""

    def poll(self) -> None:
        """Turn values that have reached the host into findings (called once per optimizer step)."""

    def finalize(self, step: int) -> None:
        """The end of the run (or an exception): decide what the rules that suspect still hold, close episodes."""
        held = {kind for known in rules_for(self.area, Moment.CHECK_STEP) + rules_for(self.area, Moment.CHECK_READ)
                if known.suspects for kind in known.kinds}
        for decided in self.verdicts.flush(held) if held else []:
            self.record_confirmed(decided, step)
        self.close_episodes(step, self.context.where(), set(self.kinds), final=True)

    def restore(self) -> None:
        """Undo global changes (anomaly mode, hooks, profilers), whatever happened."""

    # --- findings -------------------------------------------------------------------------------
    def record(self, finding: Finding, step: int, where: Where | None = None, key: str = "",
               warn: bool = True) -> bool:
        """Count a finding; write an event (and a one-line warning) when it starts a new episode (returns True then).

        Past ``max_episode_events`` (N) episodes of one kind, a ``summary`` line with the kind's totals is written at
        2N, 4N, 8N, ... and at the end: few lines, and a run killed at any point leaves at least half counted.
        """
        episode_key = (finding.kind.value, key)
        self._seen_this_check.add(episode_key)
        new = self.episodes.observe(episode_key, step) is EpisodePhase.START
        self.tally.record(step, finding, new)
        if new:
            episodes = self.tally.kinds[finding.kind.value]["episodes"]
            if episodes > self.max_episode_events:
                self._silenced_episodes.add(episode_key)
                if episodes % self.max_episode_events == 0 and (episodes // self.max_episode_events) & (
                        episodes // self.max_episode_events - 1) == 0:  # 2N, 4N, 8N, ...
                    self._write_summary(finding.kind.value, where)
                return new
            if episodes == self.max_episode_events:
                finding = Finding(finding.kind, finding.severity, finding.message + (
                    f" (episode {episodes} of {finding.kind}: later ones are counted in summary lines here and in "
                    "report.json, not written one by one)"), finding.details)
            self._write_event(finding, step, where, episode=EpisodePhase.START, console=warn)
        return new

    def _write_summary(self, kind: str, where: Where | None) -> None:
        """A ``summary`` line: the totals of ``kind`` so far."""
        entry = self.tally.kinds[kind]
        if self._summarized.get(kind) == entry["episodes"]:
            return
        self._summarized[kind] = entry["episodes"]
        totals = {name: entry[name] for name in ("episodes", "steps", "first_step", "last_step")}
        message = (f"{kind}: {entry['episodes']} episodes so far over {entry['steps']} check step(s), steps "
                   f"{entry['first_step']}-{entry['last_step']}; only the first {self.max_episode_events} are written "
                   "one by one")
        self._write_event(Finding(Kind(kind), Severity.parse(entry["severity"]), message,
                                  dict(totals, written=self.max_episode_events)),
                          entry["last_step"], where, episode=EpisodePhase.SUMMARY, console=False)

    def emit(self, finding: Finding, step: int, where: Where | None = None) -> None:
        """Write a one-off event that is counted but opens no episode (a profiler trace, a fit-start fact)."""
        self.tally.record(step, finding, True)
        self._write_event(finding, step, where)

    # --- registered rules -------------------------------------------------------------------------
    def run_rules(self, moment: Moment, facts: Facts, step: int, where: Where | None = None) -> None:
        """Run every rule registered for this monitor's area at ``moment`` on ``facts``, through :meth:`take`."""
        for known in rules_for(self.area, moment):
            self.take(known, known.judge(facts), step, where)

    def take(self, known: Rule, result: Any, step: int, where: Where | None = None) -> None:
        """One path for what a rule returns, by type: a ``Finding`` is one-off (:meth:`emit`), a suspicion goes to the
        engine (every time: a hold not suspected again ends), anything with a ``finding`` is recorded; a list or tuple
        holds several."""
        results = list(result) if isinstance(result, (list, tuple)) else [] if result is None else [result]
        suspicions = [item for item in results if isinstance(item, Suspicion)]
        if known.suspects:
            for kind in known.kinds:
                confirmed = self.verdicts.observe(kind, step, [s for s in suspicions if s.kind is kind],
                                                  scope=known.name)  # its own holds: no other rule's key ends
                for decided in confirmed:
                    self.record_confirmed(decided, step, where)
        elif suspicions:
            raise TypeError(f"rule {known.name} returned suspicions; register it with suspects=True")
        for item in results:
            if isinstance(item, Finding):
                self.emit(item, step, where)
            elif not isinstance(item, Suspicion):
                self.record_verdict(item, step, where)

    def record_confirmed(self, decided: Confirmed, step: int, where: Where | None = None) -> None:
        """Record what the engine confirmed: the rule's finding, at each step the policy labels it at."""
        finding = decided.latest.finding or decided.first.finding
        if finding is not None:
            if finding.kind is not decided.kind:
                finding = Finding(decided.kind, finding.severity, finding.message, finding.details)
            self.record_verdict(Recorded(finding, list(decided.latest.flagged), decided.key, list(decided.steps)),
                                step, where)

    def record_verdict(self, verdict: Any, step: int, where: Where | None = None) -> None:
        """Record a rule's verdict (``finding``, ``key``, ``steps``) at each of its steps, or at ``step``."""
        for at in getattr(verdict, "steps", None) or [step]:
            self.record(verdict.finding, at, where, key=getattr(verdict, "key", ""))

    def _write_event(self, finding: Finding, step: int, where: Where | None, **options: Any) -> None:
        """Hand an event to the session; a failure is recorded, never raised: a write failing on one rank must not
        keep it from the decisions and collectives that follow."""
        try:
            self.session.emit(finding, step=step, where=where or self.context.where(), callback=self.source,
                              **options)
        except Exception as failure:
            self.session.failures.record("writing an event", failure, "this event is lost")

    def close_episodes(self, step: int, where: Where, kinds: Iterable[str], final: bool = False) -> None:
        """End the episodes of ``kinds`` not observed for a while (all of them when ``final``)."""
        healthy = not self.episodes.open and not self._seen_this_check  # nothing open, nothing seen
        if healthy and not final:
            return
        kinds = {str(kind) for kind in kinds}
        for kind in sorted(kinds) if final else []:
            if self.tally.kinds.get(kind, {}).get("episodes", 0) > self.max_episode_events:
                self._write_summary(kind, where)
        if healthy:
            return
        for (kind, key), episode in self.episodes.close_missing(self._seen_this_check, step, kinds, final):
            if (kind, key) in self._silenced_episodes:
                self._silenced_episodes.discard((kind, key))
                continue
            subject = f" ({key})" if key else ""
            message = (f"{kind}{subject} ended: seen on {episode['steps']} check step(s), "
                       f"steps {episode['first_step']}-{episode['last_step']}")
            self._write_event(Finding(Kind(kind), Severity.INFO, message, dict(episode, key=key)),
                        max(step, episode["last_step"]), where, episode=EpisodePhase.END)
        self._seen_this_check = {key for key in self._seen_this_check if key[0] not in kinds}

    def measurement_failed(self, failure: Exception, consequence: str, step: int) -> None:
        """The shared measurement of ``step`` failed (here or on another rank): recorded the same on every rank."""
        self.session.failures.record(f"{type(self).__name__}.before_optimizer_step", failure, consequence, step)

    def warn(self, message: str) -> None:
        """A rate-limited notice (not a finding) on the global-zero process, e.g. what a level costs."""
        if not self.bound or not self.session.is_global_zero or self._warnings_left <= 0:
            return
        self._warnings_left -= 1
        notify(f"lightning-debug: {message}")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.session.metrics.add_many(step, metrics)

    # --- resume and report ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tally": self.tally.state_dict(), "episodes": self.episodes.state_dict(),
                "verdicts": self.verdicts.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tally.load_state_dict(state_dict.get("tally", {}))
        self.episodes.load_state_dict(state_dict.get("episodes", {}))
        self.verdicts.load_state_dict(state_dict.get("verdicts", {}))

    def report_section(self) -> dict[str, Any]:
        """This area's part of report.json: ``findings`` (the tally), ``stats`` and area data."""
        return {"findings": self.tally.state_dict(),
                "check_frequency": self.frequency}
