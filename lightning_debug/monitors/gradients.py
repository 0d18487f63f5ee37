"""Gradient health: exploding, vanishing, missing gradients and parameters the optimizer never moves.

The monitor reads the shared :class:`~lightning_debug.core.step_numerics.StepNumerics` of a check
step (computed once for every callback), so gradient norms are never computed twice. Everything it
measures itself (weight updates, histograms) is fused device work read back without a sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.gradients import clip_advice, histogram_from_row, histogram_summaries, suggest_clip_value
from lightning_debug.checks.numerics import user_name
from lightning_debug.checks.trends import ABSURD_GRAD_NORM, NORM_JUMP_FACTOR, NormHistory
from lightning_debug.config import Area, DebugConfig, DebugLevel
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Decision, Event, HistogramWriter, Monitor, NumericsSource
from lightning_debug.core.metrics import metric_part
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where
from lightning_debug.core.stats import RunningStats, Window
from lightning_debug.core.step_numerics import HostNumerics, NumericsQueue, ParameterIndex

NAMES_IN_DETAILS = 20
WORST_SHOWN = 5
HISTOGRAM_BINS = 30
HEALTHY_NORMS_KEPT = 256
FLAGGED_KEPT = 200
MAX_PENDING_CHECKS = 4
# A module whose update moves its weights by more than their own norm in one step (healthy: ~1e-3)...
UPDATE_RATIO_LIMIT = 1.0
# ...unless its weights are (near) zero, as zero-initialised biases and tokens are at first.
UPDATE_RATIO_MIN_WEIGHT_RMS = 1e-3

DDP_NOTE = ("Under DDP an unused parameter makes backward fail unless the strategy finds unused parameters "
            "(Trainer(strategy='ddp_find_unused_parameters_true')), which walks the autograd graph every step; "
            "removing the parameter or freezing it with requires_grad_(False) is cheaper.")


def _quoted(names: Sequence[str], shown: int = WORST_SHOWN) -> str:
    text = ", ".join(f"`{name}`" for name in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _number_equals_zero(value: Any) -> bool:
    """A plain-number learning rate of 0; tensor learning rates are not read (that would sync)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _module_of(parameter_name: str) -> str:
    return parameter_name.rpartition(".")[0]


class FlagCounter:
    """How often each parameter was flagged, bounded: past ``limit`` names the rarest are dropped.

    Example::

        >>> counter = FlagCounter(limit=4)
        >>> counter.add(["a", "b"]); counter.add(["a"]); counter.top(1)
        [['a', 2]]
    """

    def __init__(self, limit: int = FLAGGED_KEPT) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def add(self, names: Iterable[str]) -> None:
        for name in names:
            self.counts[name] = self.counts.get(name, 0) + 1
        if len(self.counts) > self.limit:
            kept = sorted(self.counts.items(), key=lambda item: -item[1])[:self.limit // 2]
            self.counts = dict(kept)

    def top(self, count: int) -> list[list[Any]]:
        ordered = sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))
        return [[name, hits] for name, hits in ordered[:count]]


class ForwardOrder:
    """The order in which modules first run in a forward pass, recorded once with pre-hooks.

    Registration order (``named_parameters``) often differs from execution order, so "the earliest
    layers" are found by watching one forward pass and then removing the hooks: a one-time cost
    on the first training batch, nothing afterwards. A parameter owned directly by a container
    module takes the position where that module is entered; parameters of modules never entered
    (used functionally by a parent) come last, in registration order. Inside a ``torch.compile``d
    module no hook is registered (Dynamo would trace it and recompile once it is removed): its
    parameters take the compiled module's position, in registration order.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> order = ForwardOrder(); order.watch(model); _ = model(torch.ones(1, 2)); order.stop()
        >>> order.module_names
        ['', '0', '1']
    """

    def __init__(self) -> None:
        self.module_names: list[str] = []
        self._seen: set[str] = set()
        self._handles: list[Any] = []
        self._compiled: list[str] = []

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def watch(self, root: nn.Module) -> None:
        self.stop()
        self.module_names, self._seen, self._compiled = [], set(), []
        for name, module in root.named_modules():
            name = user_name(name)
            if any(name == c or name.startswith(c + ".") for c in self._compiled):
                continue
            if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
                self._compiled.append(name)
            self._handles.append(module.register_forward_pre_hook(self._hook_for(name)))

    def _hook_for(self, name: str) -> Callable[..., None]:
        def seen(module: nn.Module, args: Any) -> None:
            if name not in self._seen:
                self._seen.add(name)
                self.module_names.append(name)
        return seen

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def positions(self, parameter_names: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Sort keys (module position, registration index) for each parameter name."""
        rank = {name: index for index, name in enumerate(self.module_names)}
        unseen = len(rank)

        def module_position(module: str) -> int:
            inside = next((c for c in self._compiled if module == c or module.startswith(c + ".")), None)
            return rank.get(inside if inside is not None else module, unseen)

        return {name: (module_position(_module_of(name)), index) for index, name in enumerate(parameter_names)}


@dataclass
class ModuleLayout:
    """Which module owns each parameter slot of an index, built once per index: per-module sums of
    per-parameter values are then one ``index_add_`` (no Python loop over parameters per check)."""

    modules: list[str]
    slot_module: torch.Tensor
    elements: torch.Tensor

    @classmethod
    def of(cls, names: Sequence[str], params: Sequence[torch.Tensor]) -> "ModuleLayout":
        position: dict[str, int] = {}
        slots = [position.setdefault(_module_of(name), len(position)) for name in names]
        slot_module = torch.tensor(slots, dtype=torch.long)
        elements = torch.zeros(len(position), dtype=torch.float64).index_add_(
            0, slot_module, torch.tensor([float(p.numel()) for p in params], dtype=torch.float64))
        return cls(list(position), slot_module, elements)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(self.modules), dtype=torch.float64).index_add_(0, self.slot_module, values.double())


@dataclass
class PendingCheck:
    """One check step between its measurement and the moment all its values are on the host."""

    step: int
    where: Where
    host: HostNumerics | None = None
    snapshot: list[torch.Tensor] = field(default_factory=list)
    index: ParameterIndex | None = None
    update_expected: bool = False
    update: Readback | None = None
    had_grad: list[bool] = field(default_factory=list)
    lr_zero_now: list[bool] = field(default_factory=list)
    layout: ModuleLayout | None = None
    histograms: list[tuple[str, list[str], Readback]] = field(default_factory=list)

    def ready(self) -> bool:
        return (self.host is not None and not (self.update_expected and self.update is None)
                and (self.update is None or self.update.ready())
                and all(readback.ready() for _, _, readback in self.histograms))


class GradientMonitor(Monitor):
    """See :class:`lightning_debug.GradientHealthCallback` for the behaviour users rely on.

    Per check step: :meth:`before_optimizer_step` registers it (gradients are final, not yet
    clipped), :meth:`after_optimizer_step` measures the weight update once the step is taken, and
    :meth:`poll` turns the values into findings and scalars once they have reached the host.

    Example::

        >>> from lightning_debug import DebugConfig
        >>> monitor = GradientMonitor(DebugConfig(gradient_checking_frequency=10))
        >>> [step for step in range(25) if monitor.due(step)]
        [0, 10, 20]
    """

    area = Area.GRADIENTS
    kinds = frozenset({Kind.EXPLODING_GRAD, Kind.VANISHING_GRAD, Kind.MISSING_GRAD, Kind.FROZEN_PARAM,
                       Kind.UPDATE_RATIO_HIGH})
    events = frozenset({Event.START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP, Event.AFTER_OPTIMIZER_STEP,
                        Event.BATCH_END})
    frequency_field = "gradient_checking_frequency"
    histogram_every_checks = 10

    def __init__(self, config: DebugConfig, source: str = "GradientHealthCallback") -> None:
        super().__init__(config, source)
        self.counts = {"exploding": 0, "vanishing": 0, "missing": 0, "frozen": 0}
        self.checks = 0
        self.steps_without_gradients = 0
        self.global_norms = RunningStats()
        self.update_ratios = RunningStats()
        self.healthy_norms = Window(HEALTHY_NORMS_KEPT)
        self.recent_norms = NormHistory()
        # With several optimizers each one's gradients have their own scale (a GAN's D and G): one history each.
        self._norm_histories: dict[Any, NormHistory] = {None: self.recent_norms}
        self.parameter_norms: dict[str, RunningStats] = {}
        self.parameter_update_ratios: dict[str, RunningStats] = {}
        self.flagged = {kind.value: FlagCounter() for kind in sorted(self.kinds)}
        self.clip_suggestion: dict[str, Any] | None = None
        self.trainability: dict[str, Any] = {}
        self.static_frozen: dict[str, list[str]] = {}
        self._param_groups: Sequence[dict[str, Any]] = []
        self.order = ForwardOrder()
        self.order_source = "registration order (named_parameters)"
        self._positions: dict[str, tuple[int, int]] = {}
        self._static_recorded_step = -1
        self._pending: dict[int, PendingCheck] = {}
        self._awaiting_update: PendingCheck | None = None
        self._histogram_writer: HistogramWriter | None = None
        self._said_sharded = False
        self._layout: tuple[ParameterIndex | None, ModuleLayout | None] = (None, None)

    # --- configuration --------------------------------------------------------------------------
    @property
    def measures_updates(self) -> bool:
        return self.config.log_weights or self.config.level >= DebugLevel.ADVANCED

    def bind(self, session: Any, context: Any, numerics: NumericsQueue) -> None:
        super().bind(session, context, numerics)
        if self.measures_updates:  # weight norms and update ratios need every weight's norm on check steps
            numerics.param_norms_wanted.append(self.optimizer_step_due)

    @property
    def wants_histograms(self) -> bool:
        return self.config.log_gradients or self.config.log_weights

    def histograms_due(self, step: int) -> bool:
        if self._histogram_writer is None or not self.wants_histograms:
            return False
        every = 1 if self.config.level >= DebugLevel.EXPERT else self.histogram_every_checks
        return (self.numerics.scheduled_step(step) // self.config.gradient_checking_frequency) % every == 0

    # --- fit start ------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """What is known before any tensor work: trainability and what the optimizer holds; then the
        module execution order is recorded during the first forward pass."""
        context, where = self.context, self.context.where()
        named = [(user_name(name), p) for name, p in context.named_parameters()]
        self._positions = {name: (0, index) for index, (name, _) in enumerate(named)}
        if self.session.is_global_zero:
            self._histogram_writer, histogram_logger = context.histogram_writer()
            if self.wants_histograms and self._histogram_writer is None:
                self.warn(f"log_gradients/log_weights write histograms to TensorBoard, but the logger "
                          f"({histogram_logger or 'none'}) cannot; histograms are skipped, scalars are still "
                          "logged.")
        trainable = [(name, p) for name, p in named if p.requires_grad]
        untrainable = [(name, p) for name, p in named if not p.requires_grad]
        self.trainability = {
            "trainable_parameters": len(trainable),
            "trainable_elements": sum(p.numel() for _, p in trainable),
            "requires_grad_false_parameters": len(untrainable),
            "requires_grad_false_elements": sum(p.numel() for _, p in untrainable),
            "requires_grad_false_names": [name for name, _ in untrainable[:NAMES_IN_DETAILS]],
        }
        if untrainable:
            self.session.emit(Finding(
                Kind.REQUIRES_GRAD_FALSE, Severity.INFO,
                f"{len(untrainable)} of {len(named)} parameters ({self.trainability['requires_grad_false_elements']:,} "
                f"elements) have requires_grad=False and are not trained by design: "
                f"{_quoted(self.trainability['requires_grad_false_names'])}.",
                {"count": len(untrainable), "elements": self.trainability["requires_grad_false_elements"],
                 "parameters": self.trainability["requires_grad_false_names"]}),
                step=step, where=where, callback=self.source)
        self._param_groups = context.param_groups()
        self.static_frozen = self._frozen_by_optimizer(trainable, self._param_groups)
        self._record_static_frozen(step, where)
        self._static_recorded_step = step
        module = context.module()
        if module is not None:
            self.order.watch(module)

    def _frozen_by_optimizer(self, trainable: list[tuple[str, nn.Parameter]],
                             param_groups: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
        if not param_groups or not trainable:
            return {}
        names = {id(p): name for name, p in trainable}
        in_optimizer: set[int] = set()
        zero_lr: set[int] = set()
        for group in param_groups:
            ids = {id(p) for p in group.get("params", [])}
            in_optimizer |= ids
            if _number_equals_zero(group.get("initial_lr", group.get("lr"))):
                zero_lr |= ids
        if not in_optimizer & set(names):
            self.trainability["optimizer_check"] = ("skipped: the optimizer holds none of the module's parameters "
                                                    "(wrapped or flattened copies, e.g. FSDP/DeepSpeed)")
            return {}
        self.trainability["optimizer_check"] = "done"
        found = {"not_in_optimizer": [n for i, n in names.items() if i not in in_optimizer],
                 "lr_zero": [n for i, n in names.items() if i in zero_lr]}
        return {cause: found_names for cause, found_names in found.items() if found_names}

    def _record_static_frozen(self, step: int, where: Where) -> None:
        advice = {
            "not_in_optimizer": ("are in no optimizer param group, so the optimizer never changes them. Pass them to "
                                 "the optimizer in configure_optimizers (e.g. self.parameters()), or call "
                                 "requires_grad_(False) if they are meant to stay fixed."),
            "lr_zero": ("are in a param group whose base learning rate is 0, so no scheduler can make them move. "
                        "Set a learning rate, or call requires_grad_(False) if they are meant to stay fixed."),
        }
        for cause, names in self.static_frozen.items():
            self.flagged["frozen_param"].add(names)
            self.record(Finding(
                Kind.FROZEN_PARAM, Severity.WARNING,
                f"{len(names)} trainable parameter(s) {_quoted(names)} {advice[cause]}",
                {"parameters": names[:NAMES_IN_DETAILS], "count": len(names), "cause": cause}),
                step, where, key=cause)

    # --- forward order --------------------------------------------------------------------------
    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self._stop_watching_forward()

    def batch_end(self, step: int, batch: Any) -> None:
        self._stop_watching_forward()

    def _stop_watching_forward(self) -> None:
        """The first forward pass is over: keep the module execution order (see :class:`ForwardOrder`)."""
        if not self.order.watching:
            return
        self.order.stop()
        if self.order.module_names:
            self._positions = self.order.positions([user_name(name) for name, _ in self.context.named_parameters()])
            self.order_source = "forward execution order (module pre-hooks on the first training batch)"

    def input_to_output(self, names: Iterable[str]) -> list[str]:
        """``names`` sorted from the input side of the model to the output side."""
        fallback = (len(self._positions) + 1, 0)
        return sorted(names, key=lambda name: self._positions.get(name, fallback))

    # --- check step -----------------------------------------------------------------------------
    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        """Register a check step before the optimizer step: no host sync, no norm computed twice.

        The verdicts come when the shared numerics are read back (a step later, or at fit end).
        Weight snapshots (update ratios) and histograms are taken here, only on check steps and
        only on the global-zero process, the one that reports them.
        """
        if not self.optimizer_step_due(step):
            return Decision.CONTINUE
        current = numerics()
        index = current.index
        pending = PendingCheck(step, self.context.where())
        awaiting = self._awaiting_update
        if awaiting is not None:
            if step > awaiting.step:  # its optimizer step is over (another optimizer steps now): measure it
                self._measure_update(awaiting)
            else:
                awaiting.update_expected = False
                awaiting.snapshot, awaiting.index = [], None
        self._awaiting_update = None
        on_shards = index.sharded and self._sharded_outputs_off(index)
        if self.measures_updates and self.session.is_global_zero and not on_shards and len(index):
            resting = {id(p) for group in self._param_groups if _number_equals_zero(group.get("lr"))
                       for p in group.get("params", [])}
            pending.lr_zero_now = [id(p) in resting for p in index.params] if resting else []
            pending.index = index
            if self._layout[0] is not index:
                self._layout = (index, ModuleLayout.of(index.names, index.params))
            pending.layout = self._layout[1]
            pending.snapshot = index.plan.snapshot(index.params)
            pending.update_expected = True
            self._awaiting_update = pending
        if self.histograms_due(step) and not on_shards:
            self._histograms(pending, index)
        self._pending[step] = pending
        current.subscribe(self._on_numerics)
        return Decision.CONTINUE

    def after_optimizer_step(self, steps_done: int) -> None:
        """Measure ``||Δw||`` of the last check step once its optimizer step has happened (no sync)."""
        pending = self._awaiting_update
        if pending is None or steps_done <= pending.step:
            return
        self._measure_update(pending)

    def _measure_update(self, pending: PendingCheck) -> None:
        """``||Δw||`` of ``pending``'s parameters since its snapshot, read back later (no sync)."""
        self._awaiting_update = None
        index = pending.index
        assert index is not None
        pending.had_grad = [p.grad is not None for p in index.params]
        pending.update = Readback(index.plan.distance_squares(pending.snapshot, index.params).sqrt(), blocking=False)
        pending.snapshot, pending.index = [], None

    def _histograms(self, pending: PendingCheck, index: ParameterIndex) -> None:
        """Gradient and weight histograms of every parameter, in fused operations, read back later."""
        if self.config.log_gradients:
            grads = [p.grad for p in index.params]
            names = [name for name, grad in zip(index.names, grads) if grad is not None]
            if names:
                pending.histograms.append(("debug/grad_hist/", names, Readback(histogram_summaries(
                    [grad for grad in grads if grad is not None], HISTOGRAM_BINS).reshape(-1), blocking=False)))
        if self.config.log_weights and len(index):
            pending.histograms.append(("debug/weight_hist/", index.names, Readback(
                histogram_summaries(index.params, HISTOGRAM_BINS).reshape(-1), blocking=False)))

    def _sharded_outputs_off(self, index: ParameterIndex) -> bool:
        """Weight updates and histograms are measured on rank zero's tensors, which for sharded parameters
        (DTensor, FSDP1 flat parameters) are one shard: they are switched off, saying so once. Returns True."""
        wanted = [what for what, on in (("update ratios and the frozen-parameter update check", self.measures_updates),
                                        ("histograms", self.wants_histograms)) if on]
        if wanted and not self._said_sharded:
            self._said_sharded = True
            self.warn(f"{' and '.join(wanted)} are not available for sharded parameters "
                      f"({_quoted(index.sharded_names)}), of which every rank holds only a shard; gradient and "
                      "weight norms, and the findings from them, are exact.")
        return True

    def _on_numerics(self, host: HostNumerics) -> None:
        pending = self._pending.get(host.step)
        if pending is None:
            return
        if host.failure is not None:
            del self._pending[host.step]
            if pending is self._awaiting_update:
                self._awaiting_update = None
            self.measurement_failed(host.failure, "this check step has no gradient verdict", host.step)
            return
        pending.host = host
        self.poll()

    def poll(self, final: bool = False) -> None:
        """Turn every check step whose values have all arrived into findings and scalars, in order."""
        while self._pending:
            step = min(self._pending)
            pending = self._pending[step]
            if pending.host is None:
                if final:
                    del self._pending[step]
                    continue
                break
            if not (final or pending.ready() or len(self._pending) > MAX_PENDING_CHECKS):
                break
            del self._pending[step]
            if pending is self._awaiting_update:
                self._awaiting_update = None
            self._complete(pending)

    # --- verdicts -------------------------------------------------------------------------------
    def _complete(self, pending: PendingCheck) -> None:
        host = pending.host
        assert host is not None
        step, where = pending.step, pending.where
        config = self.config
        if host.without_gradients:  # no backward ran (a training_step that returned None): nothing to judge
            self.steps_without_gradients += 1
            return
        self.checks += 1
        self.recent_norms = self._norm_histories.setdefault(where.get("optimizer"), NormHistory())
        global_norm = host.global_grad_norm
        self.global_norms.add(global_norm)
        metrics: dict[str, float] = {"debug/grad/global_norm": global_norm}

        high, low = config.gradient_explosion_threshold, config.gradient_vanishing_threshold
        fixed_high = high is not None
        # one max and one min over the norms; names are paired with norms only when one is out of range
        largest, smallest = host.grad_norm_extremes()
        jump_limit = self.recent_norms.limit()
        limit = jump_limit if jump_limit is not None else ABSURD_GRAD_NORM
        suspect_jump = math.isfinite(global_norm) and global_norm > limit
        suspect_high = fixed_high and not (largest <= high and global_norm <= high)  # NaN is suspect too
        suspect_low = not smallest >= low
        per_parameter = (suspect_high or suspect_jump or suspect_low or config.log_gradients
                         or config.level >= DebugLevel.INTERMEDIATE)
        grads = list(zip(host.grad_names, host.grad_norms)) if per_parameter else []
        above = [(name, norm) for name, norm in grads if math.isfinite(norm) and norm > high] if suspect_high else []
        if above or suspect_jump or (suspect_high and math.isfinite(global_norm) and global_norm > high):
            self._record_exploding(step, where, global_norm, grads, above,
                                   None if not suspect_jump else jump_limit if jump_limit is not None else math.inf)
        elif math.isfinite(global_norm):
            self.healthy_norms.add(global_norm)
        self.recent_norms.add(global_norm)

        if suspect_low:
            self._judge_vanishing(step, where, grads)

        if host.missing:
            self._record_missing(step, where, host.missing, len(host.param_names))

        if step != self._static_recorded_step:
            self._record_static_frozen(step, where)
        not_updated = False
        if pending.update is not None:
            update_metrics, not_updated = self._updates(pending, host)
            metrics.update(update_metrics)
        if self.static_frozen or not_updated:
            self.counts["frozen"] += 1

        metrics.update({
            "debug/grad/exploding_count": float(self.counts["exploding"]),
            "debug/grad/vanishing_count": float(self.counts["vanishing"]),
            "debug/grad/missing_count": float(self.counts["missing"]),
        })
        if config.log_gradients:
            metrics.update(zip([f"debug/grad/norm/{metric_part(name)}" for name in host.grad_names] if host.missing
                               else host.tags("debug/grad/norm/"), host.grad_norms))
        if config.log_weights:
            metrics.update(zip(host.tags("debug/weight/norm/"), host.param_norms))
        if config.level >= DebugLevel.INTERMEDIATE:
            for name, norm in grads:
                self.parameter_norms.setdefault(name, RunningStats()).add(norm)
        self._write_histograms(pending)
        self.log_metrics(step, metrics)
        self.close_episodes(step, where, self.kinds)

    def _clipping_note(self, global_norm: float) -> tuple[str, dict[str, Any]]:
        """What the loop's own clipping did to this step (the checks see the gradients before it)."""
        clipping = self.context.gradient_clipping()
        if clipping is None:
            return "", {}
        value, algorithm = clipping
        details = {"clip_val": value, "clip_algorithm": algorithm}
        if algorithm == "value":
            return (f" Gradient clipping is on (each element clipped to +-{value:g}, gradient_clip_algorithm='value'); "
                    f"the norm above is measured before clipping.", details)
        factor = global_norm / value if value > 0 else math.inf
        if factor > 1:
            details["clip_factor"] = factor
            return (f" Gradient clipping is on (gradient_clip_val={value:g}, by norm): it scaled this step's gradients "
                    f"from {global_norm:.4g} down to {value:g}, {factor:.3g}x smaller, so the update stays bounded, "
                    "but the gradients themselves are out of scale.", details)
        return f" Gradient clipping is on (gradient_clip_val={value:g}, by norm) and did not act on this step.", details

    def _record_exploding(self, step: int, where: Where, global_norm: float, grads: list[tuple[str, float]],
                          above: list[tuple[str, float]], jump_limit: float | None) -> None:
        """``jump_limit``: None when the user's fixed threshold was crossed; the limit learnt from the run's
        recent norms when the norm jumped over it; ``inf`` when the norm is absurd with no history yet."""
        self.counts["exploding"] += 1
        worst = sorted((item for item in grads if math.isfinite(item[1])), key=lambda item: -item[1])[:WORST_SHOWN]
        named = above or worst
        self.flagged["exploding_grad"].add(name for name, _ in named)
        shown = ", ".join(f"`{name}` {norm:.3g}" for name, norm in worst)
        threshold = self.config.gradient_explosion_threshold
        level = self.recent_norms.level()
        if jump_limit is None:
            what = f"global norm {global_norm:.4g} > gradient_explosion_threshold {threshold:g}"
        elif math.isfinite(jump_limit):
            what = (f"global norm {global_norm:.4g}, {global_norm / level:.3g}x its median {level:.4g} over the last "
                    f"{len(self.recent_norms.values)} check steps (a jump of over {NORM_JUMP_FACTOR:g}x)")
        else:
            what = (f"global norm {global_norm:.4g} at the first check steps, above {ABSURD_GRAD_NORM:g}, which no "
                    "model trained with a mean loss starts with")
        clip_note, clip_details = self._clipping_note(global_norm)
        if clip_details:
            clip, basis = None, "gradient clipping is already configured"
            fix = ("Lower the learning rate or add a warm-up, normalize the inputs and check the initialization; "
                   "look at the batch of this step.")
        else:
            clip, basis = suggest_clip_value(list(self.healthy_norms.values), threshold)
            fix = clip_advice(clip, basis)
        self.clip_suggestion = {"value": clip, "basis": basis, "step": step}
        self.record(Finding(
            Kind.EXPLODING_GRAD, Severity.WARNING,
            f"Gradients are exploding at step {step}: {what}; largest: {shown}.{clip_note} {fix}",
            {"global_norm": global_norm, "threshold": threshold if jump_limit is None else None,
             "judged_by": ("gradient_explosion_threshold" if jump_limit is None else
                           "jump over recent norms" if math.isfinite(jump_limit) else "absurd norm"),
             "recent_median": level if math.isfinite(level) else None,
             "limit": jump_limit if jump_limit is not None and math.isfinite(jump_limit) else None,
             "parameters": [name for name, _ in named[:NAMES_IN_DETAILS]],
             "worst": [[name, norm] for name, norm in worst], "count": len(named),
             "suggested_clip_val": clip, "clip_basis": basis, **clip_details}),
            step, where)

    def _judge_vanishing(self, step: int, where: Where, grads: list[tuple[str, float]]) -> None:
        """Vanishing gradients, judged per layer (module): the norm of all of a module's gradients below
        ``gradient_vanishing_threshold``. A parameter whose gradient is exactly zero while the rest of its
        module learns is structural (the key bias of attention: softmax ignores a shift shared by every
        key) and never counts; a whole module at zero is a dead layer."""
        low = self.config.gradient_vanishing_threshold
        members: dict[str, list[str]] = {}
        squares: dict[str, float] = {}
        for name, norm in grads:
            module = _module_of(name)
            members.setdefault(module, []).append(name)
            squares[module] = squares.get(module, 0.0) + norm * norm
        module_norms = {module: math.sqrt(value) for module, value in squares.items()}
        dying = [module for module, norm in module_norms.items() if math.isfinite(norm) and norm < low]
        if not dying:
            return
        norms = dict(grads)
        self._record_vanishing(step, where, grads, [n for m in dying for n in members[m]], module_norms, norms)

    def _record_vanishing(self, step: int, where: Where, grads: list[tuple[str, float]], below: list[str],
                          module_norms: dict[str, float], norms: dict[str, float]) -> None:
        self.counts["vanishing"] += 1
        self.flagged["vanishing_grad"].add(below)
        low = self.config.gradient_vanishing_threshold
        ordered = self.input_to_output(below)
        everything = self.input_to_output(name for name, _ in grads)
        position = {name: index for index, name in enumerate(everything)}
        last_vanishing = max(position[name] for name in below)
        healthy_after = everything[last_vanishing + 1] if last_vanishing + 1 < len(everything) else None
        layers = list(dict.fromkeys(_module_of(name) for name in ordered))
        all_layers = list(dict.fromkeys(_module_of(name) for name in everything))
        dead = [layer for layer in layers if module_norms[layer] == 0]

        def label(layer: str) -> str:
            return f"`{layer or '(root)'}`"

        def neighbours(layer: str) -> list[list[Any]]:
            index = all_layers.index(layer)
            near = [all_layers[i] for i in (index - 1, index + 1) if 0 <= i < len(all_layers)]
            return [[other, module_norms[other]] for other in near if not module_norms[other] < low]

        first = layers[0]
        around = neighbours(first)
        compared = (f" (neighbouring layers: {', '.join(f'{label(n)} {v:.3g}' for n, v in around)})"
                    if around else "")
        where_it_dies = (f"; gradients are healthy again from `{healthy_after}` on, so the signal dies on its way back "
                         "toward the input" if healthy_after else "")
        if dead and len(dead) == len(layers):
            cause = ("Their gradients are exactly zero: nothing flows back into them. Look for a layer downstream "
                     "whose weights are all zero, dead ReLUs (pre-activations all negative, often after a too-large "
                     "step), a mask or a detach()/no_grad() on the path, or a constant output.")
        else:
            cause = ("Use ReLU/GELU instead of saturating sigmoid/tanh, a better initialization (Kaiming/Xavier), "
                     "normalization layers or residual connections, and look for a detach() or no_grad() on the path."
                     + (f" {len(dead)} of these layers are exactly zero (dead ReLUs, a masked path or zero weights "
                        "downstream)." if dead else ""))
        self.record(Finding(
            Kind.VANISHING_GRAD, Severity.WARNING,
            f"{len(layers)} of {len(all_layers)} layers have a gradient norm below gradient_vanishing_threshold "
            f"{low:g} at step {step}, input side first: {', '.join(label(n) for n in layers[:WORST_SHOWN])}"
            f"{f' and {len(layers) - WORST_SHOWN} more' if len(layers) > WORST_SHOWN else ''}; {label(first)} "
            f"{module_norms[first]:.3g}{compared}{where_it_dies}. {cause}",
            {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(below), "layers": layers[:NAMES_IN_DETAILS],
             "layer_norms": {layer: module_norms[layer] for layer in layers[:NAMES_IN_DETAILS]},
             "neighbours": {layer: neighbours(layer) for layer in layers[:NAMES_IN_DETAILS]},
             "norms": {name: norms[name] for name in ordered[:NAMES_IN_DETAILS]},
             "threshold": low, "healthy_from": healthy_after,
             "exactly_zero": [name for name in ordered if norms[name] == 0][:NAMES_IN_DETAILS],
             "dead_layers": dead[:NAMES_IN_DETAILS], "order": self.order_source}),
            step, where)

    def _record_missing(self, step: int, where: Where, missing: list[str], trainable: int) -> None:
        self.counts["missing"] += 1
        self.flagged["missing_grad"].add(missing)
        ordered = self.input_to_output(missing)
        self.record(Finding(
            Kind.MISSING_GRAD, Severity.WARNING,
            f"{len(missing)} of {trainable} trainable parameters received no gradient at step {step}: "
            f"{_quoted(ordered)}. A layer that is never used in the forward, or a branch cut off by detach(), "
            f"no_grad(), .data or .item(). Use it, remove it, or call requires_grad_(False). {DDP_NOTE}",
            {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(missing),
             "layers": list(dict.fromkeys(_module_of(n) or n for n in ordered))[:NAMES_IN_DETAILS],
             "ddp": "find_unused_parameters=True is required under DDP while these stay unused"}),
            step, where)

    def _updates(self, pending: PendingCheck, host: HostNumerics) -> tuple[dict[str, float], bool]:
        """Update ratios ``||Δw|| / ||w||`` and the parameters a step left unchanged, in tensor operations
        over every parameter at once; names are paired with values only for logging and findings."""
        assert pending.update is not None
        deltas = pending.update.tensor().double()
        weights = host.param_norms_by_slot()
        gradients = host.grad_norms_by_slot()
        names = host.param_names
        metrics: dict[str, float] = {}
        ratios = torch.where(weights > 0, deltas / weights.clamp_min(torch.finfo(torch.float64).tiny),
                             torch.where(deltas > 0, math.inf, 0.0))
        if self.config.log_weights:
            metrics.update(zip(host.tags("debug/weight/update_ratio/"), ratios.tolist()))
        if self.config.level >= DebugLevel.ADVANCED:
            for name, ratio in zip(names, ratios.tolist()):
                self.parameter_update_ratios.setdefault(name, RunningStats()).add(ratio)
        delta_squares, weight_squares = float(deltas.square().sum()), float(weights.square().sum())
        if weight_squares > 0 and math.isfinite(delta_squares):
            overall = math.sqrt(delta_squares / weight_squares)
            self.update_ratios.add(overall)
            metrics["debug/weight/update_ratio_global"] = overall
        self._judge_update_ratios(pending, names, deltas, weights)
        unchanged = ((deltas == 0) & (gradients > 0) & torch.isfinite(gradients)).nonzero().flatten().tolist()
        already = {name for names_ in self.static_frozen.values() for name in names_} if unchanged else set()
        not_updated = [names[i] for i in unchanged if pending.had_grad[i] and names[i] not in already
                       and not (pending.lr_zero_now and pending.lr_zero_now[i])]
        if not_updated:
            self.flagged["frozen_param"].add(not_updated)
            ordered = self.input_to_output(not_updated)
            self.record(Finding(
                Kind.FROZEN_PARAM, Severity.WARNING,
                f"{len(not_updated)} trainable parameter(s) had a non-zero gradient but the optimizer step at step "
                f"{pending.step} left them exactly unchanged: {_quoted(ordered)}. Look for a learning rate of 0 or "
                "too small for the weights' precision (bf16/fp16 weights), a param group of an optimizer that is "
                "never stepped, or code that restores the weights.",
                {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(not_updated), "cause": "no_update"}),
                pending.step, pending.where, key="no_update")
        return metrics, bool(not_updated)

    def _judge_update_ratios(self, pending: PendingCheck, names: list[str], deltas: torch.Tensor,
                             weights: torch.Tensor) -> None:
        """``update_ratio_high``: a layer (module) whose step moved its weights by more than their own norm.

        Judged per module, so a zero-initialised bias next to its weight does not count, and only for
        modules whose weights are not (near) zero: a parameter that starts at 0 has an infinite ratio
        on its first step by construction.
        """
        layout = pending.layout
        if layout is None or layout.slot_module.numel() != len(names):
            return
        moved, size = layout.sums(deltas.square()), layout.sums(weights.square())
        ratio = (moved / size.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
        over = (torch.isfinite(moved) & torch.isfinite(size) & (size > 0) & (ratio > UPDATE_RATIO_LIMIT)
                & ((size / layout.elements.clamp_min(1.0)).sqrt() >= UPDATE_RATIO_MIN_WEIGHT_RMS))
        if not bool(over.any()):
            return
        high = [(layout.modules[i], float(ratio[i])) for i in over.nonzero().flatten().tolist()]
        high.sort(key=lambda item: -item[1])
        self.flagged["update_ratio_high"].add(module or "(root)" for module, _ in high)
        lrs = sorted({float(g["lr"]) for g in self._param_groups if isinstance(g.get("lr"), (int, float))})
        lr_text = f" (learning rate {', '.join(f'{lr:.3g}' for lr in lrs)})" if lrs else ""
        shown = ", ".join(f"`{module or '(root)'}` {ratio:.3g}" for module, ratio in high[:WORST_SHOWN])
        self.record(Finding(
            Kind.UPDATE_RATIO_HIGH, Severity.WARNING,
            f"The optimizer step at step {pending.step} changed {len(high)} layer(s) by more than their own weight "
            f"norm (||update|| / ||weight||, healthy around 1e-3): {shown}{lr_text}. The learning rate is far too "
            "high for them: lower it, add a learning-rate warm-up, clip gradients.",
            {"layers": [module for module, _ in high[:NAMES_IN_DETAILS]],
             "ratios": {module: ratio for module, ratio in high[:NAMES_IN_DETAILS]}, "limit": UPDATE_RATIO_LIMIT,
             "learning_rates": lrs}),
            pending.step, pending.where)

    def _write_histograms(self, pending: PendingCheck) -> None:
        writer = self._histogram_writer
        if writer is None or not pending.histograms:
            return
        width = 5 + HISTOGRAM_BINS
        for prefix, names, readback in pending.histograms:
            values = readback.values()
            for index, name in enumerate(names):
                writer(prefix + metric_part(name), histogram_from_row(values[index * width:(index + 1) * width], HISTOGRAM_BINS),
                       pending.step)

    # --- the end --------------------------------------------------------------------------------
    def finalize(self, step: int) -> None:
        """Evaluate every check step still waiting and close the open episodes."""
        self.order.stop()
        self.poll(final=True)
        self._awaiting_update = None
        self._pending = {}
        super().finalize(step)

    def restore(self) -> None:
        self.order.stop()

    def state_dict(self) -> dict[str, Any]:
        return dict(
            super().state_dict(), counts=dict(self.counts), checks=self.checks,
            steps_without_gradients=self.steps_without_gradients,
            global_norms=self.global_norms.state_dict(), update_ratios=self.update_ratios.state_dict(),
            healthy_norms=list(self.healthy_norms.values), recent_norms=list(self.recent_norms.values),
            parameter_norms={name: stats.state_dict() for name, stats in self.parameter_norms.items()},
            parameter_update_ratios={name: stats.state_dict() for name, stats in self.parameter_update_ratios.items()},
            flagged={kind: dict(counter.counts) for kind, counter in self.flagged.items()},
            clip_suggestion=self.clip_suggestion,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.counts.update({k: int(v) for k, v in state_dict.get("counts", {}).items()})
        self.checks = int(state_dict.get("checks", 0))
        self.steps_without_gradients = int(state_dict.get("steps_without_gradients", 0))
        if "global_norms" in state_dict:
            self.global_norms.load_state_dict(state_dict["global_norms"])
        if "update_ratios" in state_dict:
            self.update_ratios.load_state_dict(state_dict["update_ratios"])
        self.healthy_norms = Window(HEALTHY_NORMS_KEPT)
        for value in state_dict.get("healthy_norms", []):
            self.healthy_norms.add(float(value))
        self.recent_norms.load(state_dict.get("recent_norms", []))
        for target, key in ((self.parameter_norms, "parameter_norms"),
                            (self.parameter_update_ratios, "parameter_update_ratios")):
            target.clear()
            for name, stats_state in state_dict.get(key, {}).items():
                target[name] = RunningStats()
                target[name].load_state_dict(stats_state)
        for kind, counts in state_dict.get("flagged", {}).items():
            self.flagged.setdefault(kind, FlagCounter()).counts = {name: int(c) for name, c in counts.items()}
        self.clip_suggestion = state_dict.get("clip_suggestion")

    def report_section(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"gradient_norm": self.global_norms.summary()}
        if self.update_ratios.count:
            stats["update_ratio"] = self.update_ratios.summary()
        section: dict[str, Any] = dict(
            super().report_section(), stats=stats, checks=self.checks,
            steps_without_gradients=self.steps_without_gradients,
            counts={f"{kind}_checks": count for kind, count in self.counts.items()},
            most_flagged={kind: counter.top(10) for kind, counter in self.flagged.items() if counter.counts},
            trainability=self.trainability, clip_suggestion=self.clip_suggestion, order=self.order_source,
        )
        if self.config.level >= DebugLevel.INTERMEDIATE:
            section["parameter_norms"] = {name: s.summary() for name, s in self.parameter_norms.items()}
        if self.parameter_update_ratios:
            section["parameter_update_ratios"] = {name: s.summary() for name, s in self.parameter_update_ratios.items()}
        return section
