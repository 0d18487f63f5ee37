"""The gradient monitor's plumbing: it reads a check step's shared numerics (norms computed once for every callback),
measures updates and histograms as fused device work read back without a sync, feeds the rules, records verdicts."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from lightning_debug.checks.gradients import loss_reaches
from lightning_debug.checks.numerics import user_name
from lightning_debug.checks.trends import NormHistory
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.kinds import Kind
from lightning_debug.core.metrics import metric_part, per_optimizer
from lightning_debug.core.gate import distributed
from lightning_debug.core.monitor import Decision, Event, HistogramWriter, Monitor, NumericsSource
from lightning_debug.core.readback import Readback
from lightning_debug.core.rules import CheckRead, CheckStep, FitStart, Moment
from lightning_debug.core.session import Where
from lightning_debug.core.stats import RunningStats
from lightning_debug.core.numerics import HostNumerics, NumericsQueue, ParameterIndex, StepNumerics
from lightning_debug.monitors.gradients.fade import judge_fade
from lightning_debug.monitors.gradients.exploding import (EARLY_STEPS, ClipAlgorithm, Clipping, Decided, Explosions,
                                                          judge_exploding, suspect_early, suspect_explosion)
from lightning_debug.monitors.gradients.history import GradientHistory, MeasuredSteps
from lightning_debug.monitors.gradients.layout import ModuleLayout, replica_groups
from lightning_debug.monitors.gradients.missing import CandidateWatch, judge_intermittent, judge_missing
from lightning_debug.monitors.gradients.order import ForwardOrder
from lightning_debug.monitors.gradients.pending import PendingCheck, PendingChecks
from lightning_debug.monitors.gradients.progress import Drift, WeightDrift
from lightning_debug.monitors.gradients.replicas import judge_replicas
from lightning_debug.monitors.gradients.shared_batches import batch_print
from lightning_debug.monitors.gradients.settings import GradientSettings
from lightning_debug.monitors.gradients.symmetry import UnitSpread
from lightning_debug.monitors.gradients.stalled import resting_slots
from lightning_debug.monitors.gradients.trainability import (FrozenCause, OutsideTraining, frozen_by_optimizer,
                                                             static_frozen_verdicts, trainability)
from lightning_debug.monitors.gradients.unregistered import Unregistered, unregistered_verdict
from lightning_debug.monitors.gradients.unstepped import Unstepped, uncounted_verdict, unstepped_verdict
from lightning_debug.monitors.gradients.update_ratio import read_updates, step_loss
from lightning_debug.monitors.gradients.vanishing import judge_vanishing
from lightning_debug.monitors.gradients.weight_decay import decay_per_step
from lightning_debug.monitors.gradients.verdict import Verdict, quoted

WHERES_KEPT = 64


class GradientMonitor(Monitor):
    """See :class:`lightning_debug.GradientHealthCallback`. Per check step: :meth:`before_optimizer_step` registers
    it (gradients final, not yet clipped), :meth:`after_optimizer_step` measures the weight update, and :meth:`poll`
    turns the values into findings and scalars once they have reached the host::

        >>> monitor = GradientMonitor(DebugConfig(gradient_checking_frequency=10))
        >>> [step for step in range(25) if monitor.due(step)]
        [0, 10, 20]
    """

    area = Area.GRADIENTS
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP,
                        Event.AFTER_OPTIMIZER_STEP, Event.BATCH_END})

    def __init__(self, config: DebugConfig, source: str = "GradientHealthCallback") -> None:
        super().__init__(config, source)
        self.settings = GradientSettings.from_config(config)
        self.history = GradientHistory((kind.value for kind in self.kinds), self.verdicts)
        self.trainability: dict[str, Any] = {}
        self.static_frozen: dict[FrozenCause, list[str]] = {}
        self._outside = OutsideTraining([], [])
        self._audited: dict[Any, ParameterIndex] = {}  # per optimizer: the index whose parameters were audited
        self._param_groups: Sequence[dict[str, Any]] = []
        self._start_lrs: list[Any] = []  # each param group's lr at fit start: the base of one no scheduler drives
        self.order = ForwardOrder()
        self._dims: tuple[Any, dict[str, int]] = (None, {})  # the dimensions of the parameters of an index
        self.order_source = "registration order (named_parameters)"
        self._positions: dict[str, tuple[int, int]] = {}
        self._static_recorded_step = -1
        self._checks = PendingChecks()
        self._histogram_writer: HistogramWriter | None = None
        self._said_sharded = False
        self._layout: tuple[ParameterIndex | None, ModuleLayout | None] = (None, None)
        self._wheres: dict[int, Where] = {}
        self._last_recorded: dict[str, int] = {}
        self._norms_read: set[Any] = set()
        self._checked: dict[Any, int] = {}  # per optimizer: its last check step, to know which steps went unchecked
        self._watch = CandidateWatch()
        self._schedule: tuple[int | None, list[str]] = (None, [])
        self._trainable = 0
        self._explosions = Explosions(self.verdicts, self._judge_early)
        self._drift = WeightDrift()
        self._drifts: dict[int, tuple[Readback, int, int | None, tuple[Any, ...], float | None, str | None] | None] = {}
        self._spread = UnitSpread()
        self._spreads: dict[int, tuple[Readback, list[tuple[str, int]]]] = {}
        self.unavailable: dict[str, str] = {}  # kinds the run cannot judge, and why (report.json, report.md)
        self._backward: tuple[int, weakref.ref[torch.Tensor]] | None = None  # the last backward seen: step, loss
        self._unstepped = Unstepped()
        self._unregistered = Unregistered()
        self._several_ranks = False

    def bind(self, session: Any, context: Any, numerics: NumericsQueue) -> None:
        super().bind(session, context, numerics)
        numerics.replicas_wanted.append(self.optimizer_step_due)  # the ranks' replicas compared (several processes)
        if self.settings.measures_updates:  # weight norms and update ratios need every weight's norm on check steps
            numerics.param_norms_wanted.append(self.optimizer_step_due)

    def histograms_due(self, step: int) -> bool:
        if self._histogram_writer is None or not self.settings.wants_histograms:
            return False
        checks = self.numerics.scheduled_step(step) // self.config.gradient_checking_frequency
        return checks % self.settings.histogram_every_checks == 0

    def record_verdict(self, verdict: Any, step: int, where: Where | None = None) -> None:
        self._record(verdict, step, where or self.context.where())

    def _record(self, verdict: Verdict | None, step: int, where: Where, count: str | None = None) -> None:
        """Record a verdict at ``step``, or at each of its ``steps`` not recorded yet for its kind."""
        if verdict is None:
            return
        kind = verdict.finding.kind.value
        for at in verdict.steps or [step]:
            if verdict.steps and at <= self._last_recorded.get(kind, -1):
                continue
            self._last_recorded[kind] = max(at, self._last_recorded.get(kind, -1))
            if count is not None:
                self.history.counts[count] += 1
            self.history.flagged[kind].add(verdict.flagged)
            self.record(verdict.finding, at, self._wheres.get(at, where), key=verdict.key)

    # --- fit start and forward order -----------------------------------------------------------
    def start(self, step: int) -> None:
        """What is known before any tensor work: trainability and what the optimizer holds; then the
        module execution order is recorded during the first forward pass."""
        context, where = self.context, self.context.where()
        named = [(user_name(name), p) for name, p in context.named_parameters()]
        self._positions = {name: (0, index) for index, (name, _) in enumerate(named)}
        model = context.module()
        if model is not None:
            groups = self.session.failures.call("finding replicated layers", replica_groups, model) or {}
            self.history.missing.set_groups({user_name(name): keys for name, keys in groups.items()})
        if self.session.is_global_zero:
            self._histogram_writer, histogram_logger = context.histogram_writer()
            if self.settings.wants_histograms and self._histogram_writer is None:
                self.warn(f"log_gradients/log_weights write histograms to TensorBoard, but the logger "
                          f"({histogram_logger or 'none'}) cannot; histograms are skipped, scalars are still "
                          "logged.")
        self._several_ranks = distributed()[1] > 1
        self._param_groups = context.param_groups()
        self._start_lrs = [group.get("lr") for group in self._param_groups]
        before = context.trainable_before_start()
        self.trainability, untrainable, lost = trainability(named, self._param_groups, before)
        if untrainable is not None:
            self.session.emit(untrainable, step=step, where=where, callback=self.source)
            if before is None and untrainable.details["in_optimizer"]:
                self.unavailable[f"{Kind.FROZEN_PARAM.value} ({FrozenCause.REQUIRES_GRAD_FALSE.value})"] = (
                    "the run first saw the model at its start, so a parameter frozen before it while an optimizer "
                    "holds it cannot be told from one built frozen; both are taken as frozen by design")
        self._schedule = context.schedule()
        if self._schedule[0] is None:
            self.unavailable[Kind.LEARNING_STALLED.value] = (
                "the run's length is unknown (no max_steps nor a sized loader; with Accelerate pass "
                "AccelerateDebugger(total_steps=...)), so a learning rate that reaches 0 early cannot be told from "
                "a schedule that ends there")
        trainable = {n: p for n, p in named if p.requires_grad}
        self.static_frozen, optimizer_check = frozen_by_optimizer(list(trainable.items()), self._param_groups)
        outside = self.static_frozen.pop(FrozenCause.NOT_IN_OPTIMIZER, [])  # judged once their gradients are seen
        if lost:
            self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE] = lost
        self._outside = OutsideTraining(list(trainable.items()), outside)
        if optimizer_check is not None:
            self.trainability["optimizer_check"] = optimizer_check
        self._record_static_frozen(step, where)
        self._static_recorded_step = step
        module = context.module()
        owners = {} if module is None else {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}
        self.run_rules(Moment.FIT_START, FitStart(
            step, module, [(name, p, owners.get(id(p))) for name, p in named], self._param_groups,
            self._schedule[0], self._schedule[1], self._start_lrs, self.verdicts, self.settings), step, where)
        if module is not None:
            self.order.watch(module)
        self._unstepped.watch(context.optimizers())

    def _record_static_frozen(self, step: int, where: Where) -> None:
        for verdict in static_frozen_verdicts(self.static_frozen):
            self._record(verdict, step, where)

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        """On a check step under several processes, the batch's fingerprint joins the shared pass's collective
        (``same_batch_on_ranks``). No sync."""
        if self._several_ranks and self.due(step):
            fingerprint = batch_print(batch)
            if fingerprint is not None:
                self.numerics.observe_batch(step, fingerprint)

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        """The loss of a check step's micro-batches, for the rules that read it and for report.md, also when this
        callback runs alone (the same tensor observed by ``AnomalyDetectionCallback`` counts once). No sync."""
        self._stop_watching_forward()
        self._backward = (step, weakref.ref(loss))
        self._unstepped.backward()
        due = self.due(step)
        if due or self.numerics.several_optimizers:
            self.numerics.observe_loss(step, loss)
        if due and self._unregistered.due(step):
            self._judge_unregistered(step, loss)
        if not due and self._explosions.watching and step < EARLY_STEPS:  # for the first steps' overflow
            self._explosions.observe_loss(step, loss)

    def _judge_unregistered(self, step: int, loss: torch.Tensor) -> None:
        known = {id(p) for _, p in self.context.named_parameters()}
        known.update(id(p) for group in self.context.param_groups() for p in group.get("params", ()))
        since = self._unregistered.walked_at
        unchanged = self._unregistered.walk(step, loss, known)
        if unchanged and since is not None:
            verdict = unregistered_verdict(step, since, unchanged, self.context.module())
            self._record(verdict, step, self.context.where())

    def batch_end(self, step: int, batch: Any) -> None:
        self._stop_watching_forward()
        if self._unstepped.batch_ended(step, self._trained):
            self._record(unstepped_verdict(step, self._unstepped, self.verdicts, False), step, self.context.where())
        self._record(uncounted_verdict(step, self._unstepped, self.verdicts), step, self.context.where())

    def _trained(self) -> list[torch.Tensor]:
        """The parameters an optimizer holds (none in a fit without an optimizer: nothing to judge)."""
        held = {id(p) for group in self._param_groups for p in group.get("params", ())}
        return [p for _, p in self.context.named_parameters() if id(p) in held]

    def _stop_watching_forward(self) -> None:
        """The first forward pass is over: keep the module execution order and which modules ran (:mod:`.missing`)."""
        if not self.order.watching:
            return
        self.order.stop()
        if self.order.module_names:
            names = [user_name(name) for name, _ in self.context.named_parameters()]
            self._positions = self.order.positions(names)
            self.history.missing.set_called(self.order.called(names), self.order.without_graph(names))
            self.order_source = "forward execution order (module pre-hooks on the first training batch)"

    # --- check step -----------------------------------------------------------------------------
    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        """Register a check step (no sync, no norm computed twice); its verdicts come when the shared numerics are
        read back. Weight snapshots and histograms are taken on global zero only."""
        self._unstepped.step_events += 1
        if self._watch:
            self._observe_candidates(step)
        if not self.optimizer_step_due(step):
            explosions = self._explosions
            if explosions.measuring or explosions.watching:  # after a jump, or among the first steps
                where = self.context.where()
                early = explosions.watching and explosions.early(where.get("optimizer"), step)
                explosions.measure(step, where.get("optimizer"), self.context.grad_scale,
                                   lambda optimizer: self.numerics.index(self.context.named_parameters),
                                   where if early else None)
            return Decision.CONTINUE
        total, schedulers = self._schedule
        norms = self.history.recent_norms
        self.run_rules(Moment.CHECK_STEP, CheckStep(step, self._param_groups, self._start_lrs, total, schedulers,
                                                    self.verdicts, self.settings, norms.last_loss, norms.first_loss),
                       step, self.context.where())
        current = numerics()
        index = current.index
        pending = PendingCheck(step, self.context.where(), judged=index, backward=self._backward_of(step, current),
                               early=step < EARLY_STEPS)
        if pending.early:
            self._explosions.watch_early(pending.where.get("optimizer"), index)
        self._audit_trainable(pending.where.get("optimizer"), index)
        pending.outside_with_grad = self._outside.look()
        self._wheres[step] = pending.where
        while len(self._wheres) > WHERES_KEPT:
            del self._wheres[min(self._wheres)]
        if not index.sharded:
            self._drifts = {s: r for s, r in self._drifts.items() if s in self._wheres}
            self._drifts[step] = self._drift.measure(step, index.params, self._unstepped.counted_steps,
                                                     [g.get("lr") for g in self._param_groups if g.get("params")],
                                                     self.context.optimizers())
            self._spreads = {s: r for s, r in self._spreads.items() if s in self._wheres}
            if (spread := self._spread.measure(step, index.names, index.params)) is not None:
                self._spreads[step] = spread
        awaiting, self._checks.awaiting_update = self._checks.awaiting_update, None
        if awaiting is not None:
            if step > awaiting.step:  # its optimizer step is over (another optimizer steps now): measure it
                awaiting.measure_update()
            else:
                awaiting.update_expected = False
                awaiting.snapshot, awaiting.index = [], None
        on_shards = index.sharded and self._sharded_outputs_off(index)
        if self.settings.measures_updates and self.session.is_global_zero and not on_shards and len(index):
            if self._layout[0] is not index:
                self._layout = (index, ModuleLayout.of(index.names, index.params))
            resting = resting_slots(self._param_groups, index.params, self._start_lrs)
            pending.snapshot_weights(index, self._layout[1], resting)
            self._checks.awaiting_update = pending
        if self.histograms_due(step) and not on_shards:
            pending.capture_histograms(index, self.settings.log_gradients, self.settings.log_weights)
        self._checks.add(pending)
        current.subscribe(self._on_numerics)
        return Decision.CONTINUE

    def _read_rules(self, step: int, measured: tuple[Readback, int, int | None, tuple[Any, ...], float | None] | None,
                    host: HostNumerics,
                    where: Where) -> None:
        """The rules of :data:`Moment.CHECK_READ`, with the weights' drift, how alike each layer's units are and the
        run's first loss."""
        first = self._drift.reference(step, step_loss(host))
        values = measured[0].values() if measured is not None and measured[0].ready() else None
        drift = None if values is None or measured is None else Drift.read(values, *measured[1:])
        spread = self._spreads.pop(step, None)
        units = (UnitSpread.spreads(spread[0].values(), spread[1]) if spread is not None and spread[0].ready()
                 else None)
        self.run_rules(Moment.CHECK_READ, CheckRead(
            step, host, where, step_loss(host), first, drift, self._param_groups, self._start_lrs, self._schedule[0],
            self.history, self.verdicts, self.settings, units, self.context.gradient_clipping()), step, where)

    def _backward_of(self, step: int, current: StepNumerics) -> bool | None:
        """None when no backward of ``step`` ran before its optimizer step, else whether its loss reaches a parameter
        (walked only when no parameter holds a gradient, while the loss is alive: unknown counts as reaching)."""
        if self._backward is None or self._backward[0] != step:
            return None
        loss = self._backward[1]()
        return not current.without_gradients or loss is None or loss_reaches(loss, current.index.params)

    def after_optimizer_step(self, steps_done: int) -> None:
        """Measure ``||Δw||`` of the last check step once its optimizer step has happened (no sync)."""
        pending = self._checks.awaiting_update
        if pending is None or steps_done <= pending.step:
            return
        self._checks.awaiting_update = None
        pending.measure_update()

    def _sharded_outputs_off(self, index: ParameterIndex) -> bool:
        """Updates and histograms of sharded parameters would read one shard: off, said once. Returns True."""
        wanted = [what for what, on in (("update ratios and the frozen-parameter update check",
                                         self.settings.measures_updates),
                                        ("histograms", self.settings.wants_histograms)) if on]
        if wanted and not self._said_sharded:
            self._said_sharded = True
            self.warn(f"{' and '.join(wanted)} are not available for sharded parameters "
                      f"({quoted(index.sharded_names)}), of which every rank holds only a shard; gradient and "
                      "weight norms, and the findings from them, are exact.")
        return True

    def _on_numerics(self, host: HostNumerics) -> None:
        pending = self._checks.waiting.get(host.step)
        if pending is None:
            return
        if host.failure is not None:
            self._checks.drop(host.step)
            self.measurement_failed(host.failure, "this check step has no gradient verdict", host.step)
            return
        pending.host = host
        self.poll()

    def poll(self, final: bool = False) -> None:
        """Turn every check step whose values have all arrived into findings and scalars, in order (the norms of the
        steps between them read in their place)."""
        for pending in self._checks.ready(final):
            if self._explosions.measuring:
                self._record_explosions(self._explosions.read(before=pending.step))
            self._complete(pending)
        if self._explosions.measuring or final:
            self._record_explosions(self._explosions.read(final, until=min(self._checks.waiting, default=None)))

    # --- verdicts -------------------------------------------------------------------------------
    def _complete(self, pending: PendingCheck) -> None:
        host = pending.host
        assert host is not None
        step, where, settings = pending.step, pending.where, self.settings
        if host.without_gradients:
            if pending.backward is None:  # no backward ran (a training_step that returned None): nothing to judge
                self.history.steps_without_gradients += 1
                return
            self.history.missing.loss_reaches = pending.backward  # a backward ran, no parameter held a gradient
            self._judge_missing(pending, host, where.get("optimizer"))
            return
        self.history.checks += 1
        self._record(judge_replicas(step, host.replica_names, host.replica_squares()), step, where)
        optimizer = where.get("optimizer")
        norms = self.history.norms_for(optimizer)
        global_norm = host.global_grad_norm
        self.history.global_norms.add(global_norm)
        scaled = self.context.uses_grad_scaler
        self._note_nonfinite(step, host, global_norm, scaled)
        metrics: dict[str, float] = {"debug/grad/global_norm": global_norm}

        # one max and one min over the norms; names are paired with norms only when one is out of range
        largest, smallest = host.grad_norm_extremes()
        before, self._checked[optimizer] = self._checked.get(optimizer), step
        named_between = before is not None and before < (self.ledger.nonfinite_grads_at or -1) <= step
        unchecked = before if before is not None and step - before > 1 and not named_between else None
        suspicion = suspect_explosion(global_norm, largest, norms, settings, host.loss_value, scaled, unchecked)
        suspect_low = not smallest >= settings.vanishing_threshold
        first_check = optimizer not in self._norms_read  # the layers' first norms, for the vanishing trend
        self._norms_read.add(optimizer)
        clip = self.context.gradient_clipping()
        clipping = None if clip is None else Clipping(clip[0], ClipAlgorithm.parse(clip[1]))
        grads = (list(zip(host.grad_names, host.grad_norms))
                 if suspicion.any or suspect_low or first_check or settings.per_parameter_always else [])
        exploding = judge_exploding(step, global_norm, grads, suspicion, settings, norms,
                                    list(self.history.healthy_norms.values), clipping, host.loss_value)
        self._record_explosions(self._explosions.judge(step, optimizer, global_norm, exploding, suspicion.deferred,
                                                       where, pending.judged))
        if pending.early:
            self._explosions.early_norm(optimizer, global_norm, host.loss_value)
        if exploding is None and math.isfinite(global_norm) and global_norm > 0:
            self.history.healthy_norms.add(global_norm)
        norms.add(global_norm, host.loss_value)
        self._record(judge_vanishing(step, grads, settings, self._positions, self.order_source, self.history.vanishing,
                                     self.verdicts, host.loss_value, norms.first_loss,
                                     decay_per_step(self._param_groups)),
                     step, where, "vanishing")
        if pending.judged is not None and self._dims[0] is not pending.judged:
            self._dims = (pending.judged, {n: p.dim() for n, p in zip(pending.judged.names, pending.judged.params)})
        self._record(judge_fade(step, list(zip(host.grad_names, host.grad_norms)), self._dims[1], self._positions,
                                self.order_source, self.verdicts), step, where, "vanishing")
        self._judge_missing(pending, host, optimizer)
        self._judge_outside(pending)
        self._read_rules(step, self._drifts.pop(step, None), host, where)
        if step != self._static_recorded_step:
            self._record_static_frozen(step, where)
        not_updated = False
        if pending.update is not None:
            update_metrics, verdicts = read_updates(
                step, optimizer, pending.update.tensor(), host, pending.layout, pending.had_grad, pending.lr_zero_now,
                settings, self.history, self._param_groups, set().union(*self.static_frozen.values()),
                self._positions, self.verdicts, self.ledger.reevaluates)
            metrics.update(update_metrics)
            for verdict in verdicts:
                self._record(verdict, step, where)
                not_updated = not_updated or verdict.finding.kind is Kind.FROZEN_PARAM
        if self.static_frozen or not_updated:
            self.history.counts["frozen"] += 1

        metrics.update({f"debug/grad/{count}_count": float(self.history.counts[count])
                        for count in ("exploding", "vanishing", "missing")})
        if settings.log_gradients:
            metrics.update(zip([f"debug/grad/norm/{metric_part(name)}" for name in host.grad_names] if host.missing
                               else host.tags("debug/grad/norm/"), host.grad_norms))
        if settings.log_weights:
            metrics.update(zip(host.tags("debug/weight/norm/"), host.param_norms))
        if settings.keeps_parameter_norms:
            for name, norm in grads:
                self.history.parameter_norms.setdefault(name, RunningStats()).add(norm)
        pending.write_histograms(self._histogram_writer)
        self.log_metrics(step, per_optimizer(metrics, optimizer))
        self.close_episodes(step, where, self.kinds)

    def _judge_early(self, step: int, global_norm: float, grads: list[tuple[str, float]], history: NormHistory,
                     loss: float) -> tuple[Verdict | None, bool]:
        """One of the first steps that is no check step (:data:`.EARLY_STEPS`), against every step before it; returns
        its verdict and whether the steps after it decide."""
        suspicion = suspect_early(global_norm, history, loss, self.context.uses_grad_scaler)
        if not suspicion.any:
            return None, False
        clip = self.context.gradient_clipping()
        clipping = None if clip is None else Clipping(clip[0], ClipAlgorithm.parse(clip[1]))
        return (judge_exploding(step, global_norm, grads, suspicion, self.settings, history,
                                list(self.history.healthy_norms.values), clipping, loss, early=True),
                suspicion.deferred)

    def _note_nonfinite(self, step: int, host: HostNumerics, global_norm: float, scaled: bool) -> None:
        """What was measured non-finite, for report.md whatever the rules say (GradScaler overflows apart)."""
        bad_loss = bool(host.ranks_with_nonfinite_loss)
        bad_grads = not math.isfinite(global_norm)
        if bad_grads and scaled and not bad_loss:
            self.history.scaler_overflows += 1
            bad_grads = False
        bad_params = host.params_measured and bool(host.ranks_with_nonfinite_params)
        for what, bad in (("gradients", bad_grads), ("loss", bad_loss), ("parameters", bad_params)):
            if bad:
                self.history.nonfinite.setdefault(what, MeasuredSteps()).add(step)

    def _record_explosions(self, decided: Decided) -> None:
        for step, verdict, where in decided:
            self._record(verdict, step, where, "exploding")
            details = verdict.finding.details
            self.history.clip_suggestion = {"value": details["suggested_clip_val"], "basis": details["clip_basis"],
                                            "step": step}

    # --- parameters left out of training: missing gradients and outside training --------------------
    def _judge_missing(self, pending: PendingCheck, host: HostNumerics, optimizer: Any) -> None:
        """Parameters that gradients do not train on purpose are not judged here (see :class:`.OutsideTraining`)."""
        missing = self.history.missing
        without, judged = host.missing, host.param_names
        if self._outside.names:
            outside = self._outside.names
            without, judged = [n for n in without if n not in outside], [n for n in judged if n not in outside]
        seen = missing.observe_check(pending.step, optimizer, without, judged)
        self._trainable = len(judged)
        if seen.confirmed or seen.newly_confirmed:  # a confirmed candidate changed by other code is left out now
            self._left_out(seen.confirmed + seen.newly_confirmed, pending.step, pending.where)
            seen.confirmed = [n for n in seen.confirmed if n not in self._outside.names]
            seen.newly_confirmed = [n for n in seen.newly_confirmed if n not in self._outside.names]
        if seen.candidates:
            self.history.counts["missing"] += 1
        self._record(judge_missing(pending.step, seen.confirmed + seen.newly_confirmed, self._trainable,
                                   self._positions, missing, seen.newly_confirmed), pending.step, pending.where)
        self._record(judge_intermittent(seen.intermittent, optimizer, self._positions, missing), pending.step,
                     pending.where)
        if pending.judged is not None:
            waiting = [n for n in seen.candidates if not missing.is_confirmed(n)]
            replicas = missing.replicas_after_check(without) if waiting else []
            self._watch.replace(optimizer, waiting + replicas, host.grad_names, pending.judged.names,
                                pending.judged.params)

    def _audit_trainable(self, optimizer: Any, index: Any) -> None:
        """Parameters made trainable or created since fit start (an index built again: rare; a layer replaced in the
        module's own ``on_train_start``, which runs after the callbacks') are looked up in the param groups."""
        if index is self._audited.get(optimizer):
            return
        self._audited[optimizer] = index
        self._param_groups = self.context.param_groups()
        named = [(user_name(name), p) for name, p in self.context.named_parameters() if p.requires_grad]
        frozen, _ = frozen_by_optimizer(named, self._param_groups)
        self._outside.extend(named, frozen.get(FrozenCause.NOT_IN_OPTIMIZER, []))
        lost = self.static_frozen.get(FrozenCause.REQUIRES_GRAD_FALSE)
        if lost:  # made trainable since: no longer frozen
            trainable = {name for name, _ in named}
            self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE] = [name for name in lost if name not in trainable]
            if not self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE]:
                del self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE]

    def _judge_outside(self, pending: PendingCheck) -> None:
        frozen, info = self._outside.judge(pending.outside_with_grad)
        if info is not None:
            self.emit(info, pending.step, pending.where)
        if frozen and self.static_frozen.get(FrozenCause.NOT_IN_OPTIMIZER) != frozen:
            self.static_frozen[FrozenCause.NOT_IN_OPTIMIZER] = frozen
            if pending.step == self._static_recorded_step:  # later check steps record it with the static causes
                for verdict in static_frozen_verdicts({FrozenCause.NOT_IN_OPTIMIZER: frozen}):
                    self._record(verdict, pending.step, pending.where)

    def _observe_candidates(self, step: int) -> None:
        """The parameters that never had a gradient, looked at on this optimizer's step (no device work)."""
        looked = self._watch.look(self.context.optimizer_index)
        if looked is None:
            return
        missing = self.history.missing
        resolved = [n for n in looked[0] if missing.is_candidate(n)]
        confirmed = missing.observe_step(step, *looked)
        if resolved or confirmed:  # fewer candidates wait: fewer replicas are worth watching
            wanted = set(missing.replicas_to_watch())
            self._watch.drop(resolved + confirmed + [n for n in looked[0] + looked[1]
                                                     if not missing.is_candidate(n) and n not in wanted])
        self._record_confirmed(confirmed, step)

    def _left_out(self, names: list[str], step: int, where: Where) -> list[str]:
        """``names`` less those whose values changed all the same (:class:`.OutsideTraining`'s from now on)."""
        kept, info = self._outside.updated_elsewhere(names, self.history.missing.had_gradient)
        if info is not None:
            self.emit(info, step, where)
        return kept

    def _record_confirmed(self, names: list[str], step: int) -> None:
        if names:
            names = self._left_out(names, step, self.context.where())
        self._record(judge_missing(step, names, self._trainable, self._positions, self.history.missing, names), step,
                     self.context.where())

    # --- the end, resume and report -------------------------------------------------------------
    def finalize(self, step: int) -> None:
        """Evaluate every check step still waiting, confirm what never had a gradient, close the open episodes."""
        self.order.stop()
        self.poll(final=True)
        self._checks.clear()
        self._record_confirmed(self.history.missing.confirm_the_rest(), step)
        self._watch.clear()
        watch = self._unstepped
        if watch.at_end(self._trained):
            self._record(unstepped_verdict(step, watch, self.verdicts, True), step, self.context.where())
        self._record(uncounted_verdict(step, watch, self.verdicts), step, self.context.where())
        if watch.optimizer_steps and not watch.step_events:
            self.unavailable["gradient checks"] = (
                f"the optimizers stepped {watch.optimizer_steps} times and the run saw none of those steps (an "
                "optimizer stepped outside the framework's wrapper: self.optimizers(use_pl_optimizer=False) under "
                "Lightning), so no check made before an optimizer step ran")
        super().finalize(step)

    def restore(self) -> None:
        self.order.stop()
        self._unstepped.release()

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), **self.history.state_dict(), units_read_at=self._spread.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.history.load_state_dict(state_dict)
        self._spread.step = state_dict.get("units_read_at")
        self._explosions.resumed()

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), **self.history.report_section(
            self.trainability, self.order_source, self.settings.keeps_parameter_norms), unavailable=self.unavailable)
