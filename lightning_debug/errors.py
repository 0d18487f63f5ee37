"""Exceptions raised on purpose by lightning-debug."""

from __future__ import annotations

from typing import Any

from lightning_debug.config_types import ConfigError

__all__ = ["AnomalyError", "ConfigError"]


class AnomalyError(RuntimeError):
    """Raised in ``anomaly_detection_mode="raise"`` when a loss, gradient or parameter is non-finite.

    Attributes:
        step: The optimizer step at which the anomaly was found.
        kinds: The event kinds found (``nonfinite_loss``, ``nonfinite_grad``, ``nonfinite_param``).
        details: What the events recorded: parameter names, ranks.
    """

    def __init__(self, message: str, step: int, kinds: list[str], details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.kinds = kinds
        self.details = details or {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.step, self.kinds, self.details))
