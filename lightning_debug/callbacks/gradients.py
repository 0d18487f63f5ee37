"""GradientHealthCallback: exploding, vanishing, missing and stuck gradients, with what to do."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area
from lightning_debug.core.kinds import with_kinds


class GradientHealthCallback(DebugCallback):
    """Are my gradients healthy, and if not, where? Checked every ``gradient_checking_frequency`` optimizer steps.

    On a check step the gradients are looked at in ``on_before_optimizer_step``, after
    accumulation and before clipping, through the run's shared fused pass (with
    :class:`~lightning_debug.AnomalyDetectionCallback` also on, norms are computed once for both).
    The values are read back a step later without a host sync; steps that are not check steps
    cost nothing. Each finding says what to do; its kinds are listed below. An explosion names the largest
    gradients, says what a configured gradient clipping did, else suggests a ``gradient_clip_val`` from this
    run's own healthy norms; vanishing layers are ordered from the input side to the output side (execution
    order seen on the first batch), a parameter with a zero gradient inside a learning module (attention's key
    bias) being structural. Check steps whose gradients, loss or weights were non-finite are stated in report.md
    and the console summary, which then never call the run clean.

    Scalars: ``debug/grad/global_norm``, ``debug/grad/{exploding,vanishing,missing}_count`` (check
    steps so far), ``debug/grad/norm/<name>`` with ``log_gradients``, ``debug/weight/norm/<name>`` and
    ``debug/weight/update_ratio/<name>`` with ``log_weights``. TensorBoard histograms
    ``debug/grad_hist/<name>`` / ``debug/weight_hist/<name>`` with ``log_gradients`` / ``log_weights``
    on every 10th check step (every check step at level EXPERT).

    With ``log_activations``, the same check steps (or the next step, when the performance profiler
    times the check step) also hook the leaf modules for one forward:
    ``debug/activation/<module>/<stat>`` (mean, std, max_abs, zero_fraction, nonfinite_count,
    saturated_fraction for sigmoid/tanh-like layers) and histograms ``debug/activation_hist/<module>`` at
    level EXPERT.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import GradientHealthCallback
        >>> trainer = pl.Trainer(callbacks=[GradientHealthCallback(gradient_checking_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.GRADIENTS


GradientHealthCallback.__doc__ = with_kinds(GradientHealthCallback.__doc__, (Area.GRADIENTS, Area.ACTIVATIONS))
