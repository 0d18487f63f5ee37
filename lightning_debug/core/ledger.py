"""Facts one monitor establishes during a run and another one needs, kept by the run.

The performance monitor times some steps; the activation statistics add forward hooks to some
steps. Hooked steps are slower for a reason that is not the user's, so the profiler leaves them
out, and the activation monitor moves its hooks off a timed step when it can. The :class:`RunLedger`
holds both facts; the run makes one and hands it to every monitor it binds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightning_debug.core.schedule import CheckSchedule

INSTRUMENTED_STEPS_KEPT = 64


@dataclass
class RunLedger:
    """Which steps are timed and which recent steps had work added by a check.

    Example::

        >>> ledger = RunLedger()
        >>> ledger.is_timed(0)  # nobody times steps
        False
        >>> ledger.timing = CheckSchedule(10)
        >>> ledger.is_timed(10), ledger.is_timed(11)
        (True, False)
        >>> ledger.instrument(10)
        >>> ledger.was_instrumented(10), ledger.was_instrumented(20)
        (True, False)
    """

    timing: CheckSchedule | None = None
    instrumented: deque[int] = field(default_factory=lambda: deque(maxlen=INSTRUMENTED_STEPS_KEPT))

    def is_timed(self, step: int) -> bool:
        """Whether the performance monitor times optimizer step ``step``."""
        return self.timing is not None and self.timing.is_due(step)

    def instrument(self, step: int) -> None:
        """A check added work (hooks) to step ``step``: its time is not the user's."""
        self.instrumented.append(step)

    def was_instrumented(self, step: int) -> bool:
        return step in self.instrumented
