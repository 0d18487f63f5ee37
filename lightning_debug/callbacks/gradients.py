"""GradientHealthCallback: exploding, vanishing, missing and stuck gradients, with what to do."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area
from lightning_debug.core.kinds import with_kinds


class GradientHealthCallback(DebugCallback):
    """Are my gradients healthy, and if not, where? Checked every ``gradient_checking_frequency`` optimizer steps.

    On a check step the gradients are read after accumulation and before clipping, in the fused pass shared with
    :class:`~lightning_debug.AnomalyDetectionCallback`, and read back a step later without a host sync; other
    steps cost nothing. Each finding says what to do. An explosion names the largest gradients and says what a
    configured clipping did, else suggests a ``gradient_clip_val`` from this run's healthy norms; vanishing layers
    are ordered from input to output, a zero gradient inside a learning module (attention's key bias) being
    structural. Check steps with non-finite gradients, loss or weights are stated in report.md and the summary.

    Scalars: ``debug/grad/global_norm``, ``debug/grad/{exploding,vanishing,missing}_count`` (check
    steps so far), ``debug/grad/norm/<name>`` with ``log_gradients``, ``debug/weight/norm/<name>`` and
    ``debug/weight/update_ratio/<name>`` with ``log_weights``. TensorBoard histograms
    ``debug/grad_hist/<name>`` / ``debug/weight_hist/<name>`` with ``log_gradients`` / ``log_weights``
    on every 10th check step (every check step at level EXPERT).

    With ``log_activations``, the same check steps hook the leaf modules for one forward:
    ``debug/activation/<module>/<stat>`` (mean, std, max_abs, zero_fraction, nonfinite_count,
    saturated_fraction for sigmoid/tanh-like layers), histograms ``debug/activation_hist/<module>`` at EXPERT.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import GradientHealthCallback
        >>> trainer = pl.Trainer(callbacks=[GradientHealthCallback(gradient_checking_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.GRADIENTS


GradientHealthCallback.__doc__ = with_kinds(GradientHealthCallback.__doc__, (Area.GRADIENTS, Area.ACTIVATIONS))
