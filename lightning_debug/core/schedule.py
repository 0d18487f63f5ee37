"""When a check runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSchedule:
    """A check that runs every ``frequency`` optimizer steps, starting at step 0.

    Steps are optimizer steps (``trainer.global_step`` before the step is taken), so gradient
    accumulation counts the same way Lightning does. With several optimizers the checks of one
    optimizer step (anomaly, gradients) count that optimizer's own steps instead
    (:meth:`~lightning_debug.core.monitor.Monitor.optimizer_step_due`), so that each is checked.

    Example::

        >>> schedule = CheckSchedule(10)
        >>> [step for step in range(25) if schedule.is_due(step)]
        [0, 10, 20]
    """

    frequency: int

    def __post_init__(self) -> None:
        if self.frequency < 1:
            raise ValueError(f"frequency must be >= 1, got {self.frequency}")

    def is_due(self, step: int) -> bool:
        return step % self.frequency == 0
