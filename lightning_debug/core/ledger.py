"""State that travels: where the loop is (:class:`StepRecord`, written by the run alone), and facts one monitor
establishes that another needs (:class:`RunLedger`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lightning_debug.checks.memory.readings import MemoryPhase
from lightning_debug.core.strenum import StrEnum

INSTRUMENTED_STEPS_KEPT = 64
NOTES_KEPT = 64


class FrameworkWork(StrEnum):
    """What the framework runs between two batches that the ledger notes (:meth:`RunLedger.note`)."""

    VALIDATION = "validation"
    CHECKPOINT_SAVING = "checkpoint saving"


class StepRecord(NamedTuple):
    """Where the training loop is, as the run last saw it; with several optimizers, the one being stepped
    (``optimizer_index``) and how many steps it took before (``optimizer_step``, what its checks count).

        >>> record = StepRecord(step=3, steps_done=3)
        >>> record.moved(optimizer_index=1).optimizer_index, record.optimizer_index
        (1, None)
        >>> record.at_batch(4) == record.moved(step=4), record.done(4) == record.moved(steps_done=4)
        (True, True)
    """

    step: int = 0
    steps_done: int = 0
    several_optimizers: bool = False
    optimizer_index: int | None = None
    optimizer_step: int | None = None

    def moved(self, **changes: Any) -> "StepRecord":
        """A copy with ``changes``: records are replaced, never edited, so a reader holds a consistent one (a named
        tuple: the run replaces it several times per step)."""
        return self._replace(**changes)

    def at_batch(self, step: int) -> "StepRecord":
        """``moved(step=step, optimizer_index=None, optimizer_step=None)`` at a fifth of the cost (every batch)."""
        return StepRecord(step, self.steps_done, self.several_optimizers, None, None)

    def done(self, steps_done: int) -> "StepRecord":
        """``moved(steps_done=steps_done)`` at a fifth of the cost (every batch end)."""
        return StepRecord(self.step, steps_done, self.several_optimizers, self.optimizer_index, self.optimizer_step)


@dataclass(frozen=True)
class CheckSchedule:
    """A check that runs every ``frequency`` optimizer steps (``trainer.global_step`` before the step), from step 0.

        >>> [step for step in range(25) if CheckSchedule(10).is_due(step)]
        [0, 10, 20]
    """

    frequency: int

    def __post_init__(self) -> None:
        if self.frequency < 1:
            raise ValueError(f"frequency must be >= 1, got {self.frequency}")

    def is_due(self, step: int) -> bool:
        return step % self.frequency == 0


@dataclass
class RunLedger:
    """Which steps are timed and which recent steps had work added by a check (the profiler leaves them out).

        >>> ledger = RunLedger()
        >>> ledger.is_timed(0)  # nobody times steps
        False
        >>> ledger.timing = CheckSchedule(10)
        >>> ledger.is_timed(10), ledger.is_timed(11)
        (True, False)
        >>> ledger.instrument(10)
        >>> ledger.was_instrumented(10), ledger.was_instrumented(20)
        (True, False)
        >>> ledger.note(5, "checkpoint saving"); ledger.note(10, "checkpoint saving")
        >>> ledger.noted([5, 10, 15])
        {'checkpoint saving': [5, 10]}
    """

    record: StepRecord = field(default_factory=StepRecord)
    timing: CheckSchedule | None = None
    instrumented: deque[int] = field(default_factory=lambda: deque(maxlen=INSTRUMENTED_STEPS_KEPT))
    notes: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=NOTES_KEPT))
    notes_hooks: bool = False
    """Whether the adapter notes the framework's work between steps (validation, checkpoint saving)."""
    reevaluates: bool = False
    """Whether an optimizer evaluated its closure again inside one step (L-BFGS, a line search): it chooses for
    itself how far a step goes, and may decline to move at all."""
    nonfinite_grads_at: int | None = None
    """The latest step whose gradients the anomaly area (every step by default) measured non-finite: the gradient
    area, checking every 100th, leaves a blow-up between its checks to ``nonfinite_grad`` rather than guess."""
    phase: MemoryPhase | None = None
    """The phase of the step the loop is in (None between batches), set at every event: what an OOM post-mortem
    names."""

    def is_timed(self, step: int) -> bool:
        """Whether the performance monitor times optimizer step ``step``."""
        return self.timing is not None and self.timing.is_due(step)

    def instrument(self, step: int) -> None:
        """A check added work (hooks) to step ``step``: its time is not the user's."""
        self.instrumented.append(step)

    def was_instrumented(self, step: int) -> bool:
        return step in self.instrumented

    def note(self, step: int, what: str) -> None:
        """The framework ran ``what`` (validation, checkpoint saving) in the time of optimizer step ``step``."""
        if not self.notes or self.notes[-1] != (step, what):
            self.notes.append((step, what))

    def forget_notes(self, step: int) -> None:
        """The time of ``step`` starts again from here (a new epoch): the last epoch's validation and checkpoint are
        not in it.

            >>> ledger = RunLedger(); ledger.note(16, "validation"); ledger.note(5, "checkpoint saving")
            >>> ledger.forget_notes(16); ledger.noted([5, 16])
            {'checkpoint saving': [5]}
        """
        if any(noted == step for noted, _ in self.notes):
            self.notes = deque(((noted, what) for noted, what in self.notes if noted != step), maxlen=NOTES_KEPT)

    def ran(self, step: int, what: FrameworkWork) -> bool:
        """Whether the framework ran ``what`` in the time of ``step`` (one of the last notes)."""
        return (step, what) in self.notes

    def noted(self, steps: Any) -> dict[str, list[int]]:
        """What the framework ran in ``steps``, by what it was, with the steps it ran in."""
        wanted = set(steps)
        out: dict[str, list[int]] = {}
        for step, what in self.notes:
            if step in wanted and step not in out.setdefault(what, []):
                out[what].append(step)
        return {what: found for what, found in out.items() if found}
