"""GradientHealthCallback: exploding, vanishing, missing and stuck gradients, with what to do."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import DebugConfig


class GradientHealthCallback(DebugCallback):
    """Gradient health on every ``gradient_checking_frequency``-th optimizer step (in development)."""

    own_fields = ("gradient_checking_frequency",)

    def __init__(
        self,
        config: DebugConfig | None = None,
        *,
        gradient_checking_frequency: int | None = None,
        gradient_explosion_threshold: float | None = None,
        gradient_vanishing_threshold: float | None = None,
        log_gradients: bool | None = None,
        log_weights: bool | None = None,
        level: str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
    ) -> None:
        super().__init__(config, gradient_checking_frequency=gradient_checking_frequency,
                         gradient_explosion_threshold=gradient_explosion_threshold,
                         gradient_vanishing_threshold=gradient_vanishing_threshold, log_gradients=log_gradients,
                         log_weights=log_weights, level=level, save_debug_info=save_debug_info,
                         debug_output_dir=debug_output_dir)
