"""The settings the gradient rules read, typed and frozen, made once from :class:`DebugConfig`::

    >>> from lightning_debug import DebugConfig
    >>> settings = GradientSettings.from_config(DebugConfig(level="advanced"))
    >>> settings.explosion_threshold is None, settings.measures_updates, settings.per_parameter_always
    (True, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lightning_debug.config import DebugConfig, DebugLevel, config_value, read_view


@dataclass(frozen=True)
class GradientSettings:
    """What the gradient rules read from the configuration; ``explosion_threshold``: None when not set (the run's
    own history judges alone), also the clip suggested before the run has healthy norms."""

    check_every: int = config_value("gradient_checking_frequency")
    explosion_threshold: float | None = config_value("gradient_explosion_threshold")
    vanishing_threshold: float = config_value("gradient_vanishing_threshold")
    log_gradients: bool = config_value("log_gradients")
    log_weights: bool = config_value("log_weights")
    level: DebugLevel = config_value("level")

    @classmethod
    def from_config(cls, config: DebugConfig) -> "GradientSettings":
        return read_view(cls, config)

    @cached_property
    def measures_updates(self) -> bool:
        """Weight updates (update ratios, parameters left unchanged) are measured on check steps."""
        return self.log_weights or self.level >= DebugLevel.ADVANCED

    @cached_property
    def keeps_update_ratios(self) -> bool:
        return self.level >= DebugLevel.ADVANCED

    @cached_property
    def per_parameter_always(self) -> bool:
        """Per-parameter norms are read on every check step, not only when something is suspect."""
        return self.log_gradients or self.level >= DebugLevel.INTERMEDIATE

    @cached_property
    def keeps_parameter_norms(self) -> bool:
        return self.level >= DebugLevel.INTERMEDIATE

    @cached_property
    def wants_histograms(self) -> bool:
        return self.log_gradients or self.log_weights

    @cached_property
    def histogram_every_checks(self) -> int:
        return 1 if self.level >= DebugLevel.EXPERT else 10
