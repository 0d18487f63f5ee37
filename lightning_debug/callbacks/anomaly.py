"""AnomalyDetectionCallback: NaN/Inf in the loss, the gradients or the parameters, at the step it happens."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_debug.callbacks.base import DebugCallback, guarded
from lightning_debug.config import DebugConfig, DebugLevel
from lightning_debug.monitors.anomaly import AnomalyMonitor


class AnomalyDetectionCallback(DebugCallback):
    """Find the step at which the loss, a gradient or a parameter stops being finite.

    On each check step (every ``anomaly_check_frequency`` optimizer steps) the loss is tested in
    ``on_before_backward`` and all gradients and parameters in one fused pass in
    ``on_before_optimizer_step``, before the optimizer can spread a NaN into the weights. Parameter
    names are looked up only when something is wrong; nothing runs per parameter on a healthy step.
    What happens next is ``anomaly_detection_mode``:

    - ``"warn"``: an event and a rate-limited warning; nothing waits for the GPU (the flags are read
      back a step later from pinned memory).
    - ``"raise"``: :class:`~lightning_debug.AnomalyError` naming the step and parameters.
    - ``"skip"``: the optimizer step does not happen (gradients dropped before ``optimizer.step``).
    - ``"stop"``: the bad update is dropped and ``trainer.should_stop`` ends training cleanly.

    The deciding modes read the flags with one host sync per check step. Under DDP/FSDP the per-rank
    flags are gathered, so every rank takes the same decision at the same step. With fp16 and a
    GradScaler, non-finite gradients with a finite loss are the scaler doing its job and are recorded
    as ``amp_overflow_skipped``. ``level=EXPERT`` also runs backward under
    ``torch.autograd.set_detect_anomaly`` (several times slower).

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import AnomalyDetectionCallback
        >>> trainer = pl.Trainer(callbacks=[AnomalyDetectionCallback(anomaly_detection_mode="skip")],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    own_fields = ("anomaly_detection_mode", "anomaly_check_frequency")

    def __init__(
        self,
        config: DebugConfig | None = None,
        *,
        anomaly_detection_mode: str | None = None,
        anomaly_check_frequency: int | None = None,
        level: DebugLevel | str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
    ) -> None:
        super().__init__(config, anomaly_detection_mode=anomaly_detection_mode,
                         anomaly_check_frequency=anomaly_check_frequency, level=level,
                         save_debug_info=save_debug_info, debug_output_dir=debug_output_dir)

    def make_monitor(self) -> AnomalyMonitor:
        return AnomalyMonitor(self.config, type(self).__name__)

    @property
    def anomalies(self) -> AnomalyMonitor:
        return self.monitor  # type: ignore[return-value]

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.anomalies.start(uses_grad_scaler=getattr(trainer.precision_plugin, "scaler", None) is not None)

    @guarded
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self.anomalies.observe_loss(trainer.global_step, loss)

    @guarded
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if self.anomalies.due(step):
            decision = self.anomalies.check(self.step_numerics(trainer, pl_module, step), self.position(trainer),
                                            optimizer)
            if decision == "stop":
                trainer.should_stop = True

    def finalize(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.anomalies.finalize(pl_module.named_parameters(), max(trainer.global_step - 1, 0), self.position(trainer))

    def restore(self, trainer: "pl.Trainer") -> None:
        self.anomalies.restore()
