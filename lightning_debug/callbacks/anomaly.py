"""AnomalyDetectionCallback: NaN/Inf in the loss, the gradients or the parameters, at the step it happens."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area
from lightning_debug.core.kinds import with_kinds


class AnomalyDetectionCallback(DebugCallback):
    """Find the step at which the loss, a gradient or a parameter stops being finite.

    On each check step (every ``anomaly_check_frequency`` optimizer steps) the loss is tested before backward
    and all gradients and parameters in one fused pass before the optimizer step, before a NaN can spread into
    the weights; nothing runs per parameter on a healthy step. What happens next is ``anomaly_detection_mode``:

    - ``"warn"``: an event and a rate-limited warning; nothing waits for the GPU (flags read a step later).
    - ``"raise"``: :class:`~lightning_debug.AnomalyError` naming the step and parameters.
    - ``"skip"``: the optimizer step does not happen (gradients dropped before ``optimizer.step``).
    - ``"stop"``: the bad update is dropped and ``trainer.should_stop`` ends training cleanly.

    The deciding modes read the flags with one host sync per check step. Under DDP/FSDP every rank takes
    the same decision at the same step. With fp16 and a GradScaler, non-finite gradients with a finite loss
    are the scaler doing its job, recorded as an info. ``level=EXPERT`` also runs backward under
    ``torch.autograd.set_detect_anomaly`` (several times slower). The same check judges the finite loss
    against its recent level: a spike that stays and a steady rise are early signs of a learning rate far too high.

    From ``level=ADVANCED``, and at every level when the parameters live on the host (a CPU run, where it costs
    nothing), the first step of each anomaly episode is replayed (same batch, RNG state and
    parameters, all restored afterwards) to name the cause: the batch itself, the first module and operation
    that made a NaN/Inf from finite inputs (for a NaN loss the first that made NaN, such as a softmax over a
    fully masked row) with its source line, or the backward operation. The replay calls ``training_step``
    again (``self.log`` muted): guard your own lists, counters and metric updates with
    ``lightning_debug.is_replaying()``. On a GPU it costs one sync per check step even in ``warn`` mode (the
    replay needs the pre-update parameters), hence ADVANCED there. Manual optimization is not replayed.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import AnomalyDetectionCallback
        >>> trainer = pl.Trainer(callbacks=[AnomalyDetectionCallback(anomaly_detection_mode="skip")],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.ANOMALY


AnomalyDetectionCallback.__doc__ = with_kinds(AnomalyDetectionCallback.__doc__, (Area.ANOMALY,))
