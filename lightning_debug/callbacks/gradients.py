"""GradientHealthCallback: exploding, vanishing, missing and stuck gradients, with what to do."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area


class GradientHealthCallback(DebugCallback):
    """Are my gradients healthy, and if not, where? Checked every ``gradient_checking_frequency`` optimizer steps.

    On a check step the gradients are looked at in ``on_before_optimizer_step``, after
    accumulation and before clipping, through the run's shared fused pass (with
    :class:`~lightning_debug.AnomalyDetectionCallback` also on, norms are computed once for both).
    The values are read back a step later without a host sync; steps that are not check steps
    cost nothing. It finds:

    - ``exploding_grad``: the global norm jumps over 10x the median of this run's recent check steps
      (judged once there are 3 of them); from the second check step, grows 1000x over the last ones or
      turns Inf/NaN with the loss blown up or with the steps since the finite check step before unchecked (at the
      default frequency, an explosion between check steps 0 and 100); or, when you set it, exceeds
      ``gradient_explosion_threshold``; names the largest, says what a configured gradient clipping
      did, else suggests a ``gradient_clip_val`` from this run's own healthy norms. Check steps whose
      gradients, loss or weights were non-finite are stated in report.md and the console summary,
      which then never call the run clean.
    - ``vanishing_grad``: layers (modules) whose gradient norm is below ``gradient_vanishing_threshold``,
      ordered from the input side to the output side (execution order seen on the first batch); a
      parameter with a zero gradient inside a learning module (attention's key bias) is structural.
    - ``update_ratio_high`` (with ``log_weights`` or level ADVANCED): a layer whose optimizer step
      moved its weights by more than their own norm.
    - ``missing_grad``: trainable parameters that received no gradient (unused layer, detached branch).
    - ``frozen_param``: trainable parameters the optimizer cannot move (in no param group, base lr 0),
      found at fit start; with ``log_weights`` or level ADVANCED, also parameters with a gradient
      that the optimizer step left unchanged (``||Δw|| = 0``).
    - ``learning_stalled``: every param group's learning rate is 0 far from the end of the run (a scheduler
      that reaches 0 early).
    - ``replicas_diverged`` (error, several processes): the ranks of a data-parallel (DDP) run hold different
      copies of parameters every rank holds whole (compared from their norms on check steps; shards of FSDP2 or
      tensor parallelism are not replicas): clipping or a gradient edit on one rank, a reload or re-initialisation
      there, a forward around the DDP wrapper.
    - Infos: ``intermittent_grad`` (parameters with a gradient on some steps only: experts, LayerDrop),
      ``requires_grad_false`` (parameters frozen on purpose, at fit start), ``outside_training``
      (parameters gradients do not train on purpose: an EMA copy, a teacher under ``no_grad``) and
      ``weight_decay_on_norm`` (weight decay on biases, norms or embeddings).

    Scalars: ``debug/grad/global_norm``, ``debug/grad/{exploding,vanishing,missing}_count`` (check
    steps so far), ``debug/grad/norm/<name>`` with ``log_gradients``, ``debug/weight/norm/<name>`` and
    ``debug/weight/update_ratio/<name>`` with ``log_weights``. TensorBoard histograms
    ``debug/grad_hist/<name>`` / ``debug/weight_hist/<name>`` with ``log_gradients`` / ``log_weights``
    on every 10th check step (every check step at level EXPERT).

    With ``log_activations``, the same check steps (or the next step, when the performance profiler
    times the check step) also hook the leaf modules for one forward:
    ``debug/activation/<module>/<stat>`` (mean, std, max_abs, zero_fraction, nonfinite_count,
    saturated_fraction for sigmoid/tanh-like layers), ``dead_activation`` (a ReLU whose outputs are
    almost all zero) and ``saturated_activation`` (a sigmoid/tanh pinned at its limits), histograms
    ``debug/activation_hist/<module>`` at level EXPERT.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import GradientHealthCallback
        >>> trainer = pl.Trainer(callbacks=[GradientHealthCallback(gradient_checking_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.GRADIENTS
