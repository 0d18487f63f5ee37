"""GradientHealthCallback: exploding, vanishing, missing and stuck gradients, with what to do."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_debug.callbacks.base import DebugCallback, guarded
from lightning_debug.config import DebugConfig, DebugLevel
from lightning_debug.monitors.gradients import GradientMonitor, HistogramWriter


def histogram_writer_for(trainer: "pl.Trainer") -> tuple[HistogramWriter | None, str]:
    """A writer for the first logger whose experiment can write raw histograms (TensorBoard).

    Returns the writer (or None) and the names of the loggers, for the warning when none can.
    """
    names = ", ".join(type(logger).__name__ for logger in trainer.loggers) or "no logger"
    for logger in trainer.loggers:
        add_histogram_raw = getattr(getattr(logger, "experiment", None), "add_histogram_raw", None)
        if callable(add_histogram_raw):
            def write(tag: str, histogram: dict[str, Any], step: int, _add: Any = add_histogram_raw) -> None:
                _add(tag, global_step=step, **histogram)
            return write, names
    return None, names


class GradientHealthCallback(DebugCallback):
    """Are my gradients healthy, and if not, where? Checked every ``gradient_checking_frequency`` optimizer steps.

    On a check step the gradients are looked at in ``on_before_optimizer_step``, after
    accumulation and before clipping, through the run's shared fused pass (with
    :class:`~lightning_debug.AnomalyDetectionCallback` also on, norms are computed once for both).
    The values are read back a step later without a host sync; steps that are not check steps
    cost nothing. It finds:

    - ``exploding_grad``: the global norm or a parameter's norm above ``gradient_explosion_threshold``;
      names the largest and suggests a ``gradient_clip_val`` from this run's own healthy norms.
    - ``vanishing_grad``: parameters whose gradient norm is below ``gradient_vanishing_threshold``,
      ordered from the input side to the output side (execution order seen on the first batch).
    - ``missing_grad``: trainable parameters that received no gradient (unused layer, detached branch).
    - ``frozen_param``: trainable parameters the optimizer cannot move (in no param group, base lr 0),
      found at fit start; with ``log_weights`` or level ADVANCED, also parameters with a gradient
      that the optimizer step left unchanged (``||Δw|| = 0``).

    Scalars: ``debug/grad/global_norm``, ``debug/grad/{exploding,vanishing,missing}_count`` (check
    steps so far), ``debug/grad/norm/<name>`` with ``log_gradients``, ``debug/weight/norm/<name>`` and
    ``debug/weight/update_ratio/<name>`` with ``log_weights``. TensorBoard histograms
    ``debug/grad_hist/<name>`` / ``debug/weight_hist/<name>`` with ``log_gradients`` / ``log_weights``
    on every 10th check step (every check step at level EXPERT).

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import GradientHealthCallback
        >>> trainer = pl.Trainer(callbacks=[GradientHealthCallback(gradient_checking_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

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
        level: DebugLevel | str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
    ) -> None:
        super().__init__(config, gradient_checking_frequency=gradient_checking_frequency,
                         gradient_explosion_threshold=gradient_explosion_threshold,
                         gradient_vanishing_threshold=gradient_vanishing_threshold, log_gradients=log_gradients,
                         log_weights=log_weights, level=level, save_debug_info=save_debug_info,
                         debug_output_dir=debug_output_dir)

    def make_monitor(self) -> GradientMonitor:
        return GradientMonitor(self.config, type(self).__name__)

    @property
    def gradients(self) -> GradientMonitor:
        return self.monitor  # type: ignore[return-value]

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        writer, loggers = histogram_writer_for(trainer) if trainer.is_global_zero else (None, "")
        groups = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
        self.gradients.start(pl_module.named_parameters(), groups, trainer.global_step, self.position(trainer),
                             histogram_writer=writer, histogram_logger=loggers)
        self.gradients.watch_forward(pl_module)

    @guarded
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self.gradients.order.watching:
            self.gradients.stop_watching_forward(name for name, _ in pl_module.named_parameters())

    @guarded
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if self.gradients.due(step):
            self.gradients.check(self.step_numerics(trainer, pl_module, step), self.position(trainer),
                                 pl_module.named_parameters)

    @guarded
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.gradients.order.watching:
            self.gradients.stop_watching_forward(name for name, _ in pl_module.named_parameters())
        self.gradients.after_optimizer_step(trainer.global_step)

    @guarded
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.gradients.poll()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def finalize(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.gradients.finalize(max(trainer.global_step - 1, 0), self.position(trainer))

    def restore(self, trainer: "pl.Trainer") -> None:
        self.gradients.order.stop()
