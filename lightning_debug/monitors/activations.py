"""Activation statistics: what each layer outputs, dead ReLUs, saturated sigmoids.

Forward hooks on the leaf modules compute their statistics on the device at once (the output may be changed in
place later), read back once without a sync. The model's output is also measured against the probability simplex
for the gradient area's ``learning_stalled`` rule (:mod:`lightning_debug.monitors.gradients.probabilities`).
Without ``log_activations`` a forward is measured at most once every :data:`VERDICT_SPACING` optimizer steps
whatever ``gradient_checking_frequency`` is: dead and saturated layers last, and every-step hooks slow a
many-module model by a third::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_debug import DebugConfig
    >>> from lightning_debug.core.monitor import RunContext
    >>> from lightning_debug.run import Run
    >>> model = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
    >>> with torch.no_grad():
    ...     _ = model[0].bias.fill_(-100.0)
    >>> class Loop(RunContext):
    ...     def module(self): return model
    >>> config = DebugConfig(gradient_checking_frequency=1, save_debug_info=False, print_summary=False)
    >>> monitor = ActivationMonitor(config, "my_loop")
    >>> run = Run(config, Loop(), [monitor]); run.start(0)
    >>> run.batch_start(0, None); loss = model(torch.randn(8, 4)).sum(); run.before_backward(0, loss)
    >>> run.batch_end(); report = run.finish("finished", 1)
    >>> report["findings"]["dead_activation"]["first_message"][:40]
    '`1` (ReLU, fed by `0` (Linear)) outputs '
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.activations import (
    DEAD_PUSHED,
    RELU_LIKE,
    ROW,
    STATS,
    dead_units_pushed,
    first_floating,
    gives_loss,
    hooked_modules,
    made_by_affine,
    metric_names,
    output_stats,
    rectified,
    same_values,
    saturation_range,
)
from lightning_debug.checks.gradients import histogram_from_row, histogram_summaries
from lightning_debug.checks.output_gradient import (
    AVERAGE_GUESS,
    BATCH_LABELS,
    SCALED_CROSS_ENTROPY,
    SHARED,
    SIGMOID_TWICE,
    SIMPLEX,
    SOFTMAX_TWICE,
    average_guess,
    batch_labels,
    batch_softmax_fit,
    fit_tolerance,
    scaled_cross_entropy,
    shared_target,
    sigmoid_twice,
    simplex_stats,
    softmax_twice,
)
from lightning_debug.config import Area, DebugConfig, DebugLevel
from lightning_debug.core.findings import Finding
from lightning_debug.core.guard import guarded_hook
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Event, HistogramWriter, Monitor
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where
from lightning_debug.core.verdicts import Suspicion
from lightning_debug.monitors.gradients.batch_softmax import KEY as BATCH_SOFTMAX
from lightning_debug.monitors.gradients.batch_softmax import batch_softmax_suspicion
from lightning_debug.monitors.gradients.chance import KEY as CHANCE
from lightning_debug.monitors.gradients.chance import chance_suspicion, plain_learning_rates
from lightning_debug.monitors.gradients.weight_decay import decay_per_step
from lightning_debug.monitors.gradients.probabilities import JUDGED_EVERY, KEY as PROBABILITIES
from lightning_debug.monitors.gradients.probabilities import SIGMOID_KEY as SIGMOID
from lightning_debug.monitors.gradients.probabilities import (probability_suspicion, sigmoid_suspicion,
                                                              simplex_tolerance)
from lightning_debug.monitors.gradients.shared_target import KEY as SHARED_TARGET
from lightning_debug.monitors.gradients.shared_target import shared_target_suspicion
from lightning_debug.monitors.gradients.single_class import KEY as SINGLE_CLASS
from lightning_debug.monitors.gradients.single_class import single_class_suspicion
from lightning_debug.monitors.mixing import BatchMixingProbe

DEAD_FRACTION = 0.99
DEAD_ROWS = 0.5
SATURATED_FRACTION = 0.9
LOSS_KEPT = 0.25
VERDICT_SPACING = 100
MIN_ELEMENTS = 64
MIN_OUTPUT_ELEMENTS = 16
MAX_OUTPUTS = 1024
MAX_PENDING = 4
HISTOGRAM_BINS = 30
TABLE_ROWS = 40
BETWEEN_BATCHES = ((Kind.LEARNING_STALLED, SHARED_TARGET), (Kind.SINGLE_CLASS_BATCHES, SINGLE_CLASS))
"""The suspicions on the model's output confirmed by a batch other than the one that raised them."""


def _quoted(label_and_type: str) -> str:
    """``"0 (Linear)"`` as ``"`0` (Linear)"``."""
    label, _, kind = label_and_type.rpartition(" (")
    return f"`{label}` ({kind}"


@dataclass
class Output:
    """One call of one leaf module in a check step's forward."""

    label: str
    module_type: str
    shape: list[int]
    relu_like: bool
    saturating: bool
    fed_by: str | None  # "label (type)" of the module whose output this one received

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def details(self, **more: Any) -> dict[str, Any]:
        return {"modules": [self.label], "module_type": self.module_type, "fed_by": self.fed_by, "shape": self.shape,
                **more}


def split_stats(values: Sequence[float], outputs: Sequence[Output]) -> list[dict[str, float]]:
    """The stacked read-back of a forward's :data:`ROW` rows, one dict per output (without what was not measured)::

        >>> out = Output("act", "ReLU", [4], relu_like=True, saturating=False, fed_by=None)
        >>> split_stats([0.1, 0.2, 0.3, 0.5, float("nan"), 0.0, float("nan"), float("nan")], [out])
        [{'mean': 0.1, 'std': 0.2, 'max_abs': 0.3, 'zero_fraction': 0.5, 'nonfinite_count': 0.0}]
    """
    width = len(ROW)
    rows = []
    for index, output in enumerate(outputs):
        stats = dict(zip(ROW, values[index * width:(index + 1) * width]))
        if not output.saturating:
            stats.pop("saturated_fraction")
        for measured in ("dead_unit_fraction", "zero_row_fraction"):
            if not math.isfinite(stats[measured]):
                stats.pop(measured)
        rows.append(stats)
    return rows


def sparse(stats: dict[str, float]) -> bool:
    """Whether a rectified output with at most 1% of its values above zero is sparse rather than dead: most samples
    have a unit on (under :data:`DEAD_ROWS` of the rows are zero) and more than 1% of the units are on for some sample,
    as a sparse autoencoder's features are. A dead layer (every pre-activation below zero, or all but a few units that
    never switch off) passes no gradient for most samples, or through at most 1% of its units. Unmeasured (fewer
    than 8 samples, no unit dimension): not sparse::

        >>> sparse({"dead_unit_fraction": 0.8, "zero_row_fraction": 0.02}), sparse({"zero_row_fraction": 0.0})
        (True, False)
    """
    return (stats.get("dead_unit_fraction", 1.0) < DEAD_FRACTION
            and stats.get("zero_row_fraction", 1.0) < DEAD_ROWS)


def describe(output: Output) -> str:
    fed = f", fed by {_quoted(output.fed_by)}" if output.fed_by else ""
    return f"`{output.label}` ({output.module_type}{fed})"


def dead_finding(step: int, output: Output, stats: dict[str, float]) -> Finding:
    fed = f"{_quoted(output.fed_by)} and " if output.fed_by else ""
    return Finding(
        Kind.DEAD_ACTIVATION, Severity.WARNING,
        f"{describe(output)} outputs zero for {stats['zero_fraction']:.1%} of its {output.numel} values "
        f"(shape {output.shape}) at step {step}: the layer is dead, no gradient flows back through it to "
        f"{fed}the layers before. Usually a large negative bias or a too-large step pushed every "
        "pre-activation below zero: Kaiming initialisation, normalisation before the activation, a lower "
        "learning rate, or LeakyReLU/GELU.",
        output.details(zero_fraction=stats["zero_fraction"], max_abs=stats["max_abs"],
                       **{name: stats[name] for name in ("dead_unit_fraction", "zero_row_fraction") if name in stats}))


def dead_output_finding(step: int, output: Output, stats: dict[str, float], pushed: float = math.nan) -> Finding:
    units = output.shape[-1]
    dead = round(stats["dead_unit_fraction"] * units)
    asked = f", {round(pushed)} of them where the loss asks for a larger value" if math.isfinite(pushed) else ""
    return Finding(
        Kind.DEAD_ACTIVATION, Severity.WARNING,
        f"{describe(output)} gives the model's output, and {dead} of its {units} output units are zero for every "
        f"sample at step {step}{asked} (shape {output.shape}): a ReLU-like activation on the output clamps what it "
        "predicts at 0, and no gradient flows back through a unit stuck there (a class whose logit is below 0 "
        "can never be learnt). Remove the activation from the output layer (cross_entropy takes raw logits); for "
        "a non-negative target use softplus or predict its log.",
        output.details(dead_units=dead, dead_unit_fraction=stats["dead_unit_fraction"],
                       zero_fraction=stats["zero_fraction"], output=True,
                       **({"dead_units_pushed": round(pushed)} if math.isfinite(pushed) else {})))


def saturated_output_finding(step: int, output: Output, stats: dict[str, float], loss: float,
                             first_loss: float) -> Finding:
    return Finding(
        Kind.SATURATED_ACTIVATION, Severity.WARNING,
        f"{describe(output)} gives the model's output, and {stats['saturated_fraction']:.1%} of its "
        f"{output.numel} outputs sit at the ends of its range at step {step} while the loss is still "
        f"{loss:.4g} ({loss / first_loss:.0%} of {first_loss:.4g} at the first check): the targets lie beyond "
        "what a bounded output can reach, so the model pushes it into saturation, where its derivative is ~0. "
        "Remove the bounded activation from the output (or scale the targets into its range).",
        output.details(saturated_fraction=stats["saturated_fraction"], mean=stats["mean"], loss=loss,
                       first_loss=first_loss, output=True))


def saturated_finding(step: int, output: Output, stats: dict[str, float]) -> Finding:
    return Finding(
        Kind.SATURATED_ACTIVATION, Severity.WARNING,
        f"{describe(output)} is saturated at step {step}: {stats['saturated_fraction']:.1%} of its "
        f"{output.numel} outputs sit at the ends of its range, where its derivative is ~0, so gradients vanish "
        "through it. Normalise the layer's inputs (BatchNorm/LayerNorm), use Xavier initialisation, a lower "
        "learning rate, or ReLU/GELU in hidden layers.",
        output.details(saturated_fraction=stats["saturated_fraction"], mean=stats["mean"]))


def activation_findings(step: int, outputs: Sequence[Output], rows: Sequence[dict[str, float]],
                        loss: float = math.nan, first_loss: float = math.nan,
                        first_saturated: float = math.nan, model_output: int | None = -1,
                        dead_pushed: float = math.nan) -> list[Finding]:
    """``dead_activation`` and ``saturated_activation`` of one check step's forward, in forward order.

    On a healthy model a sparse ReLU has well under 99% zeros and a hidden sigmoid sits mostly inside its range.
    Ruled out: outputs under :data:`MIN_ELEMENTS` values (noise; the model's output, held, needs
    :data:`MIN_OUTPUT_ELEMENTS`: a regression's batch of 32), the model's output saturated already at the first
    check (built confident), or while the loss fell under :data:`LOSS_KEPT` of the first check's (a classifier's
    confident sigmoid is its job), and a NaN statistic. ``model_output``: the index of the call that gives the model's
    output (the last by default; None when none does). Dead units of a rectified model output are named unless the
    output's gradient shows the loss asks none of them to rise (``dead_pushed`` 0: their targets are 0, as an
    autoencoder's blank pixels; NaN when it was not read). Saturation is held by the kind's policy::

        >>> relu = Output("act", "ReLU", [8, 16], relu_like=True, saturating=False, fed_by="fc (Linear)")
        >>> [f.kind.value for f in activation_findings(3, [relu], [{"zero_fraction": 1.0, "max_abs": 0.0}])]
        ['dead_activation']
    """
    found = []
    for index, (output, stats) in enumerate(zip(outputs, rows)):
        last = model_output is not None and index == model_output % len(outputs)
        if output.numel < (MIN_OUTPUT_ELEMENTS if last else MIN_ELEMENTS):
            continue
        if output.relu_like and stats["zero_fraction"] >= DEAD_FRACTION and not sparse(stats):
            found.append(dead_finding(step, output, stats))
        elif output.relu_like and last and stats.get("dead_unit_fraction", 0.0) > 0 and dead_pushed != 0:
            found.append(dead_output_finding(step, output, stats, dead_pushed))
        if not output.saturating or not stats["saturated_fraction"] >= SATURATED_FRACTION:
            continue
        if not last:
            found.append(saturated_finding(step, output, stats))
        elif (math.isfinite(loss) and first_loss > 0 and loss >= LOSS_KEPT * first_loss
              and not first_saturated >= SATURATED_FRACTION):
            found.append(saturated_output_finding(step, output, stats, loss, first_loss))
    return found


OUTPUT_GRADIENT = (("batch_softmax_fit",) + SHARED + SIGMOID_TWICE + BATCH_LABELS + SOFTMAX_TWICE + AVERAGE_GUESS
                   + SCALED_CROSS_ENTROPY + DEAD_PUSHED)
"""What a hook reads from the gradient of the model's output on a judged step, for the rules of its form, and on a
measured step whose output is rectified, for its dead units."""


def _writes_gradient(into: torch.Tensor, output: torch.Tensor, loss: torch.Tensor | None, judged: bool = True) -> Any:
    """A hook on the gradient of the model's ``output`` that writes its :data:`OUTPUT_GRADIENT` into ``into`` and
    leaves the gradient as it is; a reading it cannot measure stays NaN, the others are kept (the backward is the
    user's, never broken). ``loss``: the loss this backward differentiates; ``judged``: whether the rules of the
    output's form judge this step (else only its dead units are read)."""
    def write(grad: torch.Tensor) -> None:
        tolerance = fit_tolerance(grad.dtype)
        readings = ((1, lambda: batch_softmax_fit(grad, output, tolerance)),
                    (len(SHARED), lambda: shared_target(grad, output)),
                    (len(SIGMOID_TWICE), lambda: sigmoid_twice(grad, output, tolerance)),
                    (len(BATCH_LABELS), lambda: batch_labels(grad, tolerance)),
                    (len(SOFTMAX_TWICE), lambda: softmax_twice(grad, output, tolerance)),
                    (len(AVERAGE_GUESS), lambda: average_guess(grad, output, tolerance)),
                    (len(SCALED_CROSS_ENTROPY), lambda: scaled_cross_entropy(grad, output, loss, tolerance)),
                    (len(DEAD_PUSHED), lambda: dead_units_pushed(grad, output)))
        start = 0
        for index, (width, read) in enumerate(readings):
            try:
                if judged or index == len(readings) - 1:
                    into[start:start + width].copy_(read().reshape(width))
            except Exception:  # noqa: BLE001 - an unmeasured reading is not judged
                pass
            start += width
    return write


@dataclass
class PendingStats:
    step: int
    where: Where
    outputs: list[Output]
    stats: Readback
    histograms: Readback | None
    tolerance: float = 1e-3  # of the model's output on the simplex, for its dtype
    output: int | None = -1  # the index of the call that gives the model's output (None: none does)
    gradient: torch.Tensor | None = None  # the output gradient's OUTPUT_GRADIENT, written by the backward
    gradient_read: Readback | None = None  # made at the batch's end, once the backward ran
    affine: bool = False  # the model's output made by an affine map: logits, never probabilities


class ActivationMonitor(Monitor):
    """Per-module output statistics on gradient check steps (``debug/activation/<module>/<stat>``, histograms at
    EXPERT, ``<module>_call2`` for a second call); ``dead_activation`` and ``saturated_activation``."""

    area = Area.ACTIVATIONS
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BATCH_END, Event.EXCEPTION})

    def __init__(self, config: DebugConfig, source: str = "GradientHealthCallback") -> None:
        super().__init__(config, source)
        self.checks = 0
        self.latest: dict[str, dict[str, Any]] = {}
        self.latest_step = -1
        self.flagged: dict[str, dict[str, int]] = {kind.value: {} for kind in self.kinds}
        self._histogram_writer: HistogramWriter | None = None
        self._handles: list[Any] = []
        self._instrumented_step = -1
        self._spaced_from = -1  # the check step last measured (or deferred to a later step)
        self._alternate = False
        self._measure_at: int | None = None  # a deferred measurement: the first step from which to take it
        self.judged_batch: int | None = None  # the position in its epoch of the batch the output rules judged last
        self._where: Where = {}
        self._outputs: list[Output] = []
        self._rows: list[torch.Tensor] = []
        self._histogram_rows: list[torch.Tensor] = []
        self._calls: dict[str, int] = {}
        self._previous: tuple[str, torch.Tensor] | None = None  # "label (type)" and output, to name who feeds whom
        # the last call whose output may be the model's: its row (None: a module with children), output, label, type
        self._output: tuple[int | None, torch.Tensor, str, str] | None = None
        self.cleared: set[str] = set()  # the learning_stalled causes a reading proved are not the case, for good
        self.probabilities_judged = -1  # the step last judged
        self._pending: list[PendingStats] = []
        self.first_loss = self.first_saturated = math.nan  # the loss and output's saturation at the first check
        self.batch_mixing = BatchMixingProbe()

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), _handles=[], _rows=[], _histogram_rows=[], _previous=None, _output=None,
                    _pending=[])

    def start(self, step: int) -> None:
        if self.config.log_activations and self.config.level >= DebugLevel.EXPERT and self.session.is_global_zero:
            self._histogram_writer = self.context.histogram_writer()[0]

    def _measures(self, step: int) -> bool:
        """A gradient check step (spaced without ``log_activations``), or the next one when the profiler times it:
        the profiler never times the hooks; when it times every step, every other check step is measured. A step
        whose batch the output rules judged last is measured later (:meth:`_another_batch`)."""
        if step == self._instrumented_step:
            return False
        ledger = self.ledger
        if self._measure_at is not None and step >= self._measure_at:
            if ledger.is_timed(step) and not ledger.is_timed(step + 1):
                self._measure_at = step + 1
                return False
            self._measure_at = None
            return self._on_another_batch(step)
        if not self.due(step):
            return False
        if not self.config.log_activations and 0 <= self._spaced_from and step - self._spaced_from < VERDICT_SPACING:
            return False
        if ledger.is_timed(step):
            if not ledger.is_timed(step + 1):
                self._measure_at, self._spaced_from = step + 1, step
                return False
            self._alternate = not self._alternate
            if self._alternate:
                self._spaced_from = step
            return self._alternate and self._on_another_batch(step)
        self._spaced_from = step
        return self._on_another_batch(step)

    def _on_another_batch(self, step: int) -> bool:
        """Whether ``step``, about to be measured, is: not when :meth:`_another_batch` moves it later."""
        later = self._another_batch(step)
        if later is None:
            return True
        self._measure_at = later
        return False

    def _another_batch(self, step: int) -> int | None:
        """The step to measure instead of ``step`` (None: ``step``) when the output rules would judge it on the
        position in its epoch of their last judgement while a suspicion that compares two batches is held
        (``shared_target``'s mean target, ``single_class_batches``' labels): unshuffled data whose epoch divides the
        spacing shows them the same batch every time, which reads as no change. The judgement moves on by half of
        what is left of the epoch (sorted labels: another class), one step when its length is unknown."""
        if self.judged_batch is None or not self._judges(step) or not any(
                self.verdicts.hold(kind, key) is not None for kind, key in BETWEEN_BATCHES):
            return None
        where = self.context.where()
        if where.get("batch") != self.judged_batch:
            return None
        end = self.context.epoch_end_step(step, where)
        return step + (max(1, (end - step + 1) // 2) if end is not None and end >= step else 1)

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self.batch_mixing.batch_start(self.context, captured)
        if not self._measures(step):
            return
        model = self.context.module()
        if model is None:
            return
        self._instrumented_step, self._where = step, self.context.where()
        self._calls, self._outputs, self._rows, self._histogram_rows = {}, [], [], []
        self.ledger.instrument(step)
        leaves, containers = hooked_modules(model)
        failures, check = self.session.failures, f"{type(self).__name__}.observe"
        for name, module in leaves:
            self._handles.append(module.register_forward_hook(guarded_hook(failures, check, self._hook_for(name))))
        for name, module in containers:
            self._handles.append(module.register_forward_hook(guarded_hook(failures, check, self._returns_for(name))))

    def _hook_for(self, name: str) -> Any:
        def observe(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            tensor = first_floating(output)
            if tensor is None or len(self._outputs) >= MAX_OUTPUTS:
                return
            calls = self._calls[name] = self._calls.get(name, 0) + 1
            label = name if calls == 1 else f"{name}_call{calls}"
            previous = self._previous
            fed_by = previous[0] if previous is not None and args and args[0] is previous[1] else None
            saturation = saturation_range(module)
            self._rows.append(output_stats(tensor, saturation, units=isinstance(module, RELU_LIKE)))
            if self._histogram_writer is not None:
                self._histogram_rows.append(histogram_summaries([tensor], HISTOGRAM_BINS)[0])
            self._outputs.append(Output(label, type(module).__name__, list(tensor.shape),
                                        isinstance(module, RELU_LIKE), saturation is not None, fed_by))
            self._previous = (f"{label} ({type(module).__name__})", tensor)
            if tensor.dim() >= 1 and tensor.requires_grad:
                self._output = (len(self._outputs) - 1, tensor, label, type(module).__name__)
        return observe

    def _returns_for(self, name: str) -> Any:
        """What a module with children returns, when it is not its last call's output as it is or reshaped (a
        ``squeeze(-1)``): the model's output written after its last layer (``F.softmax(self.head(h), dim=1)``,
        ``h @ self.weight.T``)."""
        def observe(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            tensor = first_floating(output)
            if tensor is None or tensor.dim() < 1 or not tensor.requires_grad:
                return
            if self._output is None or not same_values(self._output[1], tensor):
                self._output = (None, tensor, name or "model", type(module).__name__)
        return observe

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self._end_forward(loss)

    def batch_end(self, step: int, batch: Any) -> None:
        self.batch_mixing.batch_end(self.context, step)
        self._end_forward()
        for pending in self._pending:
            if pending.gradient is not None and pending.gradient_read is None:
                pending.gradient_read = Readback(pending.gradient, blocking=False)
        self.poll()

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        self._remove_hooks()
        self.batch_mixing.stop()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._previous, self._output = [], None, None

    def _end_forward(self, loss: torch.Tensor | None = None) -> None:
        """The forward is over: take the hooks off and read the statistics and the loss back."""
        if not self._handles:
            return
        index, last = self._model_output(loss)
        self._remove_hooks()
        if not self._rows:
            return
        device = self._rows[0].device
        simplex = (simplex_stats(last) if last is not None
                   else torch.full((len(SIMPLEX),), math.nan, device=device))
        tolerance = simplex_tolerance(last.dtype) if last is not None else 1e-3
        measured = (loss.detach().float().mean().reshape(1).to(device, non_blocking=True)
                    if isinstance(loss, torch.Tensor) and loss.numel() else torch.full((1,), math.nan, device=device))
        stats = Readback(torch.cat([row.to(device, non_blocking=True) for row in self._rows]
                                   + [simplex.to(device, non_blocking=True), measured]), blocking=False)
        histograms = (Readback(torch.cat([row.to(device, non_blocking=True) for row in self._histogram_rows]),
                               blocking=False) if self._histogram_rows else None)
        pending = PendingStats(self._instrumented_step, self._where, self._outputs, stats, histograms, tolerance,
                               index, affine=last is not None and made_by_affine(last))
        rectified_output = index is not None and self._outputs[index].relu_like
        judged = last is not None and self._judges_gradient(pending.step, last)
        if last is not None and (judged or rectified_output and last.requires_grad):
            pending.gradient = torch.full((len(OUTPUT_GRADIENT),), math.nan, device=last.device)
            backward_of = (loss.detach() / self.context.backward_divisor()
                           if isinstance(loss, torch.Tensor) and loss.numel() else None)
            last.register_hook(_writes_gradient(pending.gradient, last.detach(), backward_of, judged))
        self._pending.append(pending)
        self._rows, self._histogram_rows, self._outputs = [], [], []
        self.poll()

    def _model_output(self, loss: torch.Tensor | None) -> tuple[int | None, torch.Tensor | None]:
        """The row and tensor of the model's output (None, None when no call gives it): the last candidate, unless the
        loss's graph shows a weight between it and the loss; one a module with children returned gets a row here."""
        if self._output is None:
            return None, None
        index, output, label, module_type = self._output
        if isinstance(loss, torch.Tensor) and gives_loss(loss, output) is False:
            return None, None
        if index is None:
            if len(self._outputs) >= MAX_OUTPUTS:
                return None, None
            relu_like = rectified(output)
            self._rows.append(output_stats(output, units=relu_like))
            if self._histogram_writer is not None:
                self._histogram_rows.append(histogram_summaries([output], HISTOGRAM_BINS)[0])
            self._outputs.append(Output(label, module_type, list(output.shape), relu_like=relu_like, saturating=False,
                                        fed_by=None))
            index = len(self._outputs) - 1
        return index, output

    def _judges_gradient(self, step: int, last: torch.Tensor) -> bool:
        """Whether ``probabilities_into_log_softmax``, ``loss_at_chance``, ``softmax_over_batch``, ``shared_target``,
        ``probabilities_into_sigmoid`` or ``single_class_batches`` wants the gradient of the model's output ``last``
        at ``step``: an output in a graph, on a step judged, while one is not cleared."""
        return (not {PROBABILITIES, CHANCE, BATCH_SOFTMAX, SHARED_TARGET, SIGMOID, SINGLE_CLASS} <= self.cleared
                and last.dim() >= 1 and last.requires_grad and self._judges(step))

    def _judges(self, step: int) -> bool:
        """Whether the rules on the model's output are judged at ``step``: at most once every ``JUDGED_EVERY`` steps."""
        return self.probabilities_judged < 0 or step - self.probabilities_judged >= JUDGED_EVERY

    @staticmethod
    def _ready(pending: PendingStats) -> bool:
        if pending.gradient is not None and pending.gradient_read is None:
            return False
        return pending.stats.ready() and (pending.gradient_read is None or pending.gradient_read.ready())

    def poll(self, final: bool = False) -> None:
        if (judged := self.batch_mixing.poll(final)) is not None:
            self.emit(*judged)
        while self._pending and (final or len(self._pending) > MAX_PENDING or self._ready(self._pending[0])):
            self._complete(self._pending.pop(0))

    def _complete(self, pending: PendingStats) -> None:
        step, where, outputs = pending.step, pending.where, pending.outputs
        names = metric_names([output.label for output in outputs])
        values = pending.stats.values()
        width = len(SIMPLEX)
        rows, simplex = split_stats(values[:-1 - width], outputs), values[-1 - width:-1]
        loss = values[-1] * self.context.loss_divisor()
        if math.isnan(self.first_loss) and math.isfinite(loss) and rows:
            self.first_loss = loss
            self.first_saturated = (rows[pending.output].get("saturated_fraction", math.nan)
                                    if pending.output is not None else math.nan)
        metrics: dict[str, float] = {}
        logged = self.config.log_activations
        self.latest, self.latest_step = {}, step
        for output, name, stats in zip(outputs, names, rows):
            if logged:
                metrics.update({f"debug/activation/{name}/{stat}": stats[stat] for stat in STATS if stat in stats})
            if logged and len(self.latest) < TABLE_ROWS:
                self.latest[output.label] = dict(stats, type=output.module_type, shape=output.shape)
        gradient = (pending.gradient_read.values() if pending.gradient_read is not None
                    else [math.nan] * len(OUTPUT_GRADIENT))
        found = activation_findings(step, outputs, rows, loss, self.first_loss, self.first_saturated,
                                    pending.output, gradient[OUTPUT_GRADIENT.index("dead_units_pushed")])
        saturated = [Suspicion(f.kind, f.details["modules"][0], step, finding=f, where=where)
                     for f in found if f.kind is Kind.SATURATED_ACTIVATION]
        for confirmed in self.verdicts.observe(Kind.SATURATED_ACTIVATION, step, saturated):
            for at in confirmed.steps:  # the first step's suspicion, where it was seen, or the latest
                seen = confirmed.first if at == confirmed.first.step else confirmed.latest
                finding = seen.finding or confirmed.latest.finding
                if finding is not None:
                    self._flag(finding, at, seen.where if seen.where is not None else where)
        for finding in found:
            if finding.kind is Kind.DEAD_ACTIVATION:
                self._flag(finding, step, where)
        if pending.output is not None:
            scale = rows[pending.output].get("max_abs", math.nan)
            self._judge_output(step, where, outputs[pending.output], simplex, loss, pending.tolerance, gradient, scale,
                               pending.affine)
        self.checks += 1
        if metrics:
            self.log_metrics(step, metrics)
        if pending.histograms is not None and self._histogram_writer is not None:
            histograms = pending.histograms.values()
            size = 5 + HISTOGRAM_BINS
            for index, name in enumerate(names):
                self._histogram_writer(f"debug/activation_hist/{name}",
                                       histogram_from_row(histograms[index * size:(index + 1) * size], HISTOGRAM_BINS),
                                       step)
        self.close_episodes(step, where, self.kinds | {Kind.LEARNING_STALLED, Kind.SINGLE_CLASS_BATCHES})

    def _judge_output(self, step: int, where: Where, output: Output, simplex: Sequence[float], loss: float,
                      tolerance: float, gradient: Sequence[float] = (), scale: float = math.nan,
                      affine: bool = False) -> None:
        """The gradient area's rules on what only this monitor measures, at most once every ``JUDGED_EVERY`` steps,
        each never again once a reading proved it is not the case: ``learning_stalled``
        (``probabilities_into_log_softmax``, ``loss_at_chance``, ``softmax_over_batch``, ``shared_target``,
        ``probabilities_into_sigmoid``) and ``single_class_batches``. An output an affine map made (``affine``) is
        logits: not probabilities a sigmoid is applied to again, whatever range one batch's values have."""
        if not self._judges(step):
            return
        if affine:
            self.cleared.add(SIGMOID)
        described = describe(output)
        read = dict(zip(OUTPUT_GRADIENT, list(gradient) or [math.nan] * len(OUTPUT_GRADIENT)))
        held = {key: self.verdicts.latest(kind, key)
                for kind, key in ((Kind.LEARNING_STALLED, SHARED_TARGET), (Kind.LEARNING_STALLED, CHANCE),
                                  (Kind.SINGLE_CLASS_BATCHES, SINGLE_CLASS))}

        def measured(key: str, name: str) -> Any:
            return None if held[key] is None else held[key].measured.get(name)

        stalled, single = Kind.LEARNING_STALLED, Kind.SINGLE_CLASS_BATCHES
        rules = {
            PROBABILITIES: (stalled, lambda since: probability_suspicion(
                step, since, described, output.label, output.shape, simplex, loss, tolerance,
                [read[name] for name in SOFTMAX_TWICE + SCALED_CROSS_ENTROPY], affine)),
            CHANCE: (stalled, lambda since: chance_suspicion(
                step, since, described, output.label, output.shape, loss, *(read[name] for name in AVERAGE_GUESS),
                rates=plain_learning_rates(self.context.param_groups()),
                rates_before=measured(CHANCE, "learning_rates"), decay=decay_per_step(self.context.param_groups()))),
            BATCH_SOFTMAX: (stalled, lambda since: batch_softmax_suspicion(
                step, since, described, output.label, output.shape, loss, read["batch_softmax_fit"])),
            SHARED_TARGET: (stalled, lambda since: shared_target_suspicion(
                step, since, described, output.label, output.shape, loss, [read[name] for name in SHARED], scale,
                tolerance, measured(SHARED_TARGET, "target"))),
            SIGMOID: (stalled, lambda since: sigmoid_suspicion(
                step, since, described, output.label, output.shape, loss, *[read[name] for name in SIGMOID_TWICE])),
            SINGLE_CLASS: (single, lambda since: single_class_suspicion(
                step, since, described, output.label, output.shape, [read[name] for name in BATCH_LABELS],
                measured(SINGLE_CLASS, "labels"))),
        }
        judged = [key for key in rules if key not in self.cleared]
        if not judged:
            return
        self.probabilities_judged, self.judged_batch = step, where.get("batch")
        found: dict[Kind, list[Suspicion]] = {stalled: [], single: []}
        for key in judged:
            kind, judge = rules[key]
            suspicion, cleared = judge(self._held_since(kind, key, step))
            if suspicion is not None and output.numel >= MIN_OUTPUT_ELEMENTS:
                found[kind].append(suspicion)
            if cleared:
                self.cleared.add(key)
        for kind, suspicions in found.items():
            keys = [key for key in judged if rules[key][0] is kind]
            if not keys:
                continue
            for confirmed in self.verdicts.observe(kind, step, suspicions, judged=keys):
                if confirmed.latest.finding is not None:
                    self.record(confirmed.latest.finding, step, where, key=confirmed.key)

    def _held_since(self, kind: Kind, key: str, step: int) -> int:
        """The step a held suspicion of ``kind`` and ``key`` began (``step`` when none is held)."""
        held = self.verdicts.hold(kind, key)
        return step if held is None else held.first.step

    def _flag(self, finding: Finding, step: int, where: Where) -> None:
        label = finding.details["modules"][0]
        counts = self.flagged[finding.kind.value]
        counts[label] = counts.get(label, 0) + 1
        self.record(finding, step, where, key=label)

    def finalize(self, step: int) -> None:
        self._remove_hooks()
        self.poll(final=True)
        super().finalize(step)
        self.close_episodes(step, self.context.where(), {Kind.LEARNING_STALLED, Kind.SINGLE_CLASS_BATCHES},
                            final=True)

    def restore(self) -> None:
        self._remove_hooks()
        self.batch_mixing.stop()

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), checks=self.checks, first_loss=self.first_loss,
                    cleared=sorted(self.cleared), probabilities_judged=self.probabilities_judged,
                    spaced_from=self._spaced_from, measure_at=self._measure_at, judged_batch=self.judged_batch,
                    first_saturated=self.first_saturated,
                    mixing=self.batch_mixing.state(),
                    flagged={kind: dict(counts) for kind, counts in self.flagged.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.checks = int(state_dict.get("checks", 0))
        self.first_loss = float(state_dict.get("first_loss", math.nan))
        self.first_saturated = float(state_dict.get("first_saturated", math.nan))
        self.cleared = set(state_dict.get("cleared", ())) | {
            key for key, old in ((PROBABILITIES, "probabilities_cleared"), (CHANCE, "chance_cleared"))
            if state_dict.get(old)}  # a checkpoint written before the set
        self.probabilities_judged = int(state_dict.get("probabilities_judged", -1))
        self._spaced_from = int(state_dict.get("spaced_from", -1))
        self._measure_at = state_dict.get("measure_at")
        self.judged_batch = state_dict.get("judged_batch")
        self.batch_mixing.outcome = state_dict.get("mixing")
        for kind, counts in state_dict.get("flagged", {}).items():
            self.flagged[kind] = {name: int(count) for name, count in counts.items()}

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), checks=self.checks, latest_step=self.latest_step,
                    logged=self.config.log_activations, batch_mixing=self.batch_mixing.outcome,
                    latest=dict(self.latest), flagged={kind: dict(c) for kind, c in self.flagged.items() if c})
