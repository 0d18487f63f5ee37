"""Non-finite loss, gradients and parameters: the plumbing of the anomaly check; the judging is in the siblings."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from lightning_debug.checks.batches import floating_tensors
from lightning_debug.checks.localize import Cause, capture_rng
from lightning_debug.checks.numerics import nonfinite_named
from lightning_debug.checks.trends import LossVerdict
from lightning_debug.checks.unbounded import fallen_far
from lightning_debug.config import AnomalyMode, Area, DebugConfig
from lightning_debug.core.buffers import BufferSnapshot, BufferWatch
from lightning_debug.core.kinds import Kind, kinds_of
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource, Replay
from lightning_debug.core.session import Where
from lightning_debug.core.numerics import HostNumerics
from lightning_debug.monitors.anomaly import policy, prose
from lightning_debug.monitors.anomaly.collectives import nan_step_plan
from lightning_debug.monitors.anomaly.divergence import LossJudge, loss_finding
from lightning_debug.monitors.anomaly.forensics import ParamsOrigin, WeightHistory, update_may_overflow
from lightning_debug.monitors.anomaly.inputs import RecentInputs, nonfinite_rows
from lightning_debug.monitors.anomaly.probe import WeightProbe
from lightning_debug.monitors.anomaly.replay import replay_step, replays_for_free, wants_replay
from lightning_debug.monitors.anomaly.settings import AnomalySettings

BAD_BATCHES_KEPT = 20
POSITIONS_KEPT = 64
DECISIONS = {policy.Action.CONTINUE: Decision.CONTINUE, policy.Action.SKIP: Decision.SKIP,
             policy.Action.STOP: Decision.STOP}


class AnomalyMonitor(Monitor):
    """See :class:`lightning_debug.AnomalyDetectionCallback` for the behaviour users rely on."""

    area = Area.ANOMALY
    closed_by_a_check = kinds_of(Area.ANOMALY) - {Kind.NONFINITE_ACTIVATION}  # an activation is only seen by a replay
    deciding = policy.DECIDING
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP})

    def __init__(self, config: DebugConfig, source: str = "AnomalyDetectionCallback") -> None:
        super().__init__(config, source)
        self.settings = AnomalySettings.from_config(config)
        self.anomaly_count = 0
        self.skipped_steps = 0
        self.restored_buffer_steps = 0
        self.localizes = self.settings.localizes
        self.weights = WeightHistory()
        self.losses = LossJudge(self.verdicts)
        self.bad_batches: list[dict[str, Any]] = []
        self._previous_detect_anomaly: tuple[bool, bool] | None = None
        self._positions: dict[int, Where] = {}
        self._causes: dict[int, Cause] = {}  # a free replay's cause, until its step is read back
        self._step_inputs: tuple[int, list[tuple[Any, Any]]] = (-1, [])
        self._learning_rates: list[float] = []
        self._inputs = RecentInputs()
        self._probe = WeightProbe()
        self._buffers = BufferSnapshot()
        self._watched = BufferWatch()
        self._undone: tuple[int, list[str], bool] = (-1, [], False)
        self.measures, self.decides = True, self.mode is not AnomalyMode.WARN
        self.plan_collectives = functools.partial(nan_step_plan, self)

    @property
    def mode(self) -> AnomalyMode:
        return self.settings.mode

    @property
    def last_finite_param_step(self) -> int:
        return self.weights.last_finite_step

    def start(self, step: int) -> None:
        if self.settings.records_stacks and self._previous_detect_anomaly is None:
            # check_nan=False: autograd must not raise inside the framework's backward (that would end a
            # warn/skip/stop run); a NaN is named by the replay, which checks NaN inside its own try.
            self._previous_detect_anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=False)
            self.warn(prose.EXPERT_STACKS)
        model = self.context.module()
        self.localizes = self.settings.localizes or (model is not None and replays_for_free(model))
        if self.settings.localizes and self.context.replay() is None:
            self.warn(prose.NO_REPLAY_IN_LOOP)
        if model is not None:
            self._watched.watch(model)

    def restore(self) -> None:
        if self._previous_detect_anomaly is not None:
            enabled, check_nan = self._previous_detect_anomaly
            torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)
            self._previous_detect_anomaly = None

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        """On check steps, flag the batch's NaN/Inf (read back with the loss) and keep it to name the samples; when
        the step can be replayed (ADVANCED, or a model on the host) also the micro-batch and RNG state. With several
        optimizers every batch is observed (which one steps next is not known yet)."""
        if not (self.due(step) or self.numerics.several_optimizers):
            return
        if self.weights.wants_measure_before(step, self._probe.step, self._may_overflow):
            self._probe.measure(step, self._index())
        if policy.restores_buffers(self.mode) and self._buffers.step != step:
            model = self.context.module()
            if model is not None:  # before the step's first forward: what a skipped step restores
                self._buffers.take(model, step)
        tensors = floating_tensors(batch)
        if tensors:
            self.numerics.observe_inputs(step, [t for _, t in tensors])
            self._inputs.add(step, self.context.where(), tensors)
        if not self.localizes or captured is None:  # nothing to recompute the step from (a loop without a forward)
            return
        if self._step_inputs[0] != step:
            self._step_inputs = (step, [])
        self._step_inputs[1].append((captured, capture_rng()))

    def _index(self) -> Any:
        return self.numerics.index(self.context.named_parameters, plain_sharded=self.context.grads_sharded)

    def _may_overflow(self, grad_norm: float) -> bool:
        return update_may_overflow(grad_norm, self._learning_rates, lambda: self._probe.largest_value(self._index()))

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        """The loss and the largest magnitude of the model's buffers after the forward, read back with the numerics."""
        if self.due(step) or self.numerics.several_optimizers:
            self.numerics.observe_loss(step, loss)
            model = self.context.module()
            if model is not None:
                self.numerics.observe_buffers(step, self._watched.measure(model))

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        """Check this step's numerics and decide the optimizer step: in ``warn`` below ADVANCED read later without a
        sync (on the host the step is replayed now, its cause kept for then: :func:`.replays_for_free`); otherwise
        now (one sync), replayed at ADVANCED. What decides comes from values every rank shares and its collectives
        are the gate's (:func:`.collectives.nan_step_plan`), so the ranks agree whatever failed."""
        if not self.optimizer_step_due(step):
            return Decision.CONTINUE
        current = numerics()
        where = self.context.where()
        self._learning_rates = [float(group.get("lr", float("nan"))) for group in optimizer.param_groups]
        replay = self.context.replay() if self.localizes else None
        if policy.reads_late(self.mode, replays=self.settings.localizes):
            self._positions[current.step] = where
            if len(self._positions) > POSITIONS_KEPT:
                self._positions.pop(min(self._positions))
            cause = self._free_replay(current, replay)
            if cause is not None:  # the first step of an episode: read back within a step or two
                self._causes[current.step] = cause
            current.subscribe(self._on_numerics)
            return Decision.CONTINUE
        host = current.read(blocking=True)
        if host.failure is not None:
            self.measurement_failed(host.failure, "every rank continues this step without an anomaly decision",
                                    host.step)
            return Decision.CONTINUE
        model = self.context.module()
        if replay is not None and current.index.sharded:
            replay = None
            if self.localizes and self.settings.localizes:  # said once: a replayed forward of sharded modules
                self.warn(prose.no_replay_on_sharded(current.index.sharded_names))  # re-runs their collectives
            self.localizes = False
        cause = self._replay(host, model, replay) if model is not None and replay is not None else None
        verdict = self._judge(host)
        self.session.failures.call("writing the anomaly findings", self._write_findings, host, where, cause, verdict)
        kinds = policy.deciding(verdict.kinds(cause))
        action = policy.decide(self.mode, kinds)
        if action is policy.Action.RAISE:
            raise prose.anomaly_error(host.step, kinds, verdict, len(host.ranks), cause)
        return DECISIONS[action]

    def _free_replay(self, current: Any, replay: Replay | None) -> Cause | None:
        """The cause of a step read late, found now while its parameters are those its forward used: on the host
        the values are already there (nothing waits), so the first step of an episode is replayed as at ADVANCED."""
        model = self.context.module()
        if replay is None or model is None or current.index.sharded:
            return None
        host = current.read(blocking=False)
        return None if host.failure is not None else self._replay(host, model, replay)

    def undo_step(self, step: int) -> bool:
        """The run dropped ``step`` on every rank: put back the buffers its forward changed and say whether some are
        still non-finite (no copy, or broken on an unchecked step); when any rank has, every rank stops."""
        self.skipped_steps += 1
        self._undone = (step, [], False)
        model = self.context.module()
        if model is None:
            return False
        try:
            restored = self._buffers.restore(model, step)
            broken = self._buffers.nonfinite(model)
        except Exception as failure:  # the run still joins the sum, so that no rank decides alone
            self.session.failures.record("restoring the buffers of a skipped step", failure,
                                         "the buffers are left as the forward changed them")
            restored, broken = False, []
        if restored:
            self.restored_buffer_steps += 1
        self._undone = (step, broken, restored)
        return bool(broken)

    def buffers_broken(self, step: int, world_size: int) -> None:
        """Some rank's buffers are still non-finite after dropping ``step``: name them (training stops)."""
        undone_step, broken, restored = self._undone
        broken, restored = (broken, restored) if undone_step == step else ([], False)
        self.record(prose.nonfinite_buffer(broken, step, restored, world_size, self.mode), step, self.context.where())

    def _replay(self, host: HostNumerics, model: torch.nn.Module, replay: Replay) -> Cause | None:
        """Localize the first step of an episode (every rank at once: the decision uses shared values only)."""
        if not wants_replay(host.ranks_with_nonfinite_loss, host.ranks_with_nonfinite_grads,
                            self.context.uses_grad_scaler, (kind for kind, _ in self.episodes.open)):
            return None
        distributed = len(host.ranks) > 1 and dist.is_available() and dist.is_initialized()
        step, inputs = self._step_inputs
        origin = host.ranks_with_nonfinite_loss or host.ranks_with_nonfinite_grads
        failed = functools.partial(self.session.failures.record, "replaying the step",
                                   consequence="the cause is not named")
        return replay_step(model, inputs if step == host.step else [], replay, distributed, self.context.replay_scope,
                           origin, failed, functools.partial(self.session.gate.gather, "replay"))

    def finalize(self, step: int) -> None:
        """Check the parameters after the last update (one sync) with no collective: this can run on an exception
        path, so each rank checks its own shards."""
        where = self.context.where()
        index = self._index()
        if len(index):
            bad = nonfinite_named(index.names, index.plan.squares(index.local_params()).sqrt())
            if bad:
                self._record_params(bad, where, 1, [0], self.weights.final_origin(step))
        for unsettled in self.losses.unsettled():
            self._record_loss(unsettled)
        super().finalize(step)

    def _on_numerics(self, host: HostNumerics) -> None:
        cause = self._causes.pop(host.step, None)
        if host.failure is not None:
            self.measurement_failed(host.failure, "every rank continues this step without an anomaly decision",
                                    host.step)
            return
        self._write_findings(host, self._positions.pop(host.step, {"epoch": -1, "batch": -1}), cause,
                             self._judge(host))

    def _judge(self, host: HostNumerics) -> policy.Verdict:
        """What ``host`` shows, the same on every rank (the scan, a collective, runs when the shared flags ask)."""
        bad_loss_ranks = host.ranks_with_nonfinite_loss
        bad_grads = host.nonfinite_grads()
        if host.ranks_with_nonfinite_grads:
            self.ledger.nonfinite_grads_at = host.step
        scan = bool(bad_loss_ranks or host.ranks_with_nonfinite_grads or host.params_measured)
        call = self.session.failures.call
        inputs = call("naming the non-finite samples", self._inputs.take, host.step) or []
        bad_input_ranks = host.ranks_with_nonfinite_inputs
        # every collective below runs on every rank whatever failed on this one (the conditions are shared)
        failed = functools.partial(self.session.failures.record, "naming the non-finite samples",
                                   consequence="the samples are not named")
        rows = (nonfinite_rows(inputs, self.context.rank, len(host.ranks), host.read_before_update, failed,
                               functools.partial(self.session.gate.gather, "rows"))
                if bad_input_ranks else [])
        verdict = policy.Verdict(bad_loss_ranks, bad_grads, host.nonfinite_params() if scan else [],
                                 self.context.uses_grad_scaler, self.last_finite_param_step, bad_input_ranks, rows,
                                 bad_buffer_ranks=host.ranks_with_nonfinite_buffers)
        model = self.context.module() if verdict.bad_buffer_ranks else None
        if model is not None:
            verdict.bad_buffers = call("naming the non-finite buffers", self._watched.nonfinite, model) or []
        if verdict.bad_params:
            verdict.params = call("tracing the non-finite weights", self.weights.origin, host.step,
                                  host.params_seen_after, bool(bad_grads), self._probe.flag(host.step),
                                  self._may_overflow)
        anomalous = verdict.anomalous()
        if anomalous:
            self.anomaly_count += 1
        call("tracing the non-finite weights", self.weights.after_check, host.step, verdict.params, bool(bad_grads),
             host.global_grad_norm, anomalous)
        return verdict

    def _write_findings(self, host: HostNumerics, where: Where, cause: Cause | None, verdict: policy.Verdict) -> None:
        """Record the findings of a judged step, root first."""
        step, world, mode = host.step, len(host.ranks), self.mode
        if verdict.bad_input_ranks:
            self._record_inputs(step, where, verdict.input_rows, verdict.bad_input_ranks, world, verdict.finite)
        if verdict.amp_overflow:
            self.record(prose.amp_overflow(step, verdict.bad_grads), step, where)
        else:
            params_first, activation = verdict.params_first, policy.names_activation(cause)
            fall = (fallen_far(self.losses.trend.recent, self.losses.trend.start)
                    if verdict.bad_loss_ranks or activation else None)
            param_ranks = host.ranks_with_nonfinite_params if host.params_measured else []
            if params_first and verdict.params is not None:
                self._record_params(verdict.bad_params, where, world, param_ranks, verdict.params)
            if activation and cause is not None:
                self.record(prose.nonfinite_activation(step, cause, params_first, fall), step, where,
                            key=cause.module or "", warn=False)
            if verdict.bad_loss_ranks:
                self.record(prose.nonfinite_loss(step, verdict, world, cause, mode, params_first, activation, fall),
                            step, where)
            if verdict.bad_grads:
                self.record(prose.nonfinite_grad(step, verdict, len(host.grad_names), host.ranks_with_nonfinite_grads,
                                                 cause, mode, params_first), step, where)
            if verdict.bad_params and not params_first:
                self._record_params(verdict.bad_params, where, world, param_ranks,
                                    verdict.params or ParamsOrigin.unknown(step))
        if verdict.bad_buffer_ranks and verdict.finite_but_buffers:  # else the loss or gradients lead
            self.record(prose.checked_buffers(step, verdict, world, mode), step, where)
        self._record_loss(self.losses.judge(host.loss_value, step, where, climb=not self.numerics.several_optimizers))
        metrics = {"debug/anomaly/count": float(self.anomaly_count)}
        if host.loss_checked:
            metrics["debug/loss_finite"] = 0.0 if verdict.bad_loss_ranks else 1.0
            if self.session.is_global_zero:
                self.session.timeline.observe_loss(step, host.loss_value)
        self.log_metrics(step, metrics)
        self.close_episodes(step, where, self.closed_by_a_check)

    def _record_loss(self, judged: LossVerdict) -> None:
        """A loss verdict, at the check step it is about (a spike's is the check before)."""
        step = judged.step if judged.step is not None else -1
        finding = loss_finding(judged, step, self._learning_rates)
        if finding is not None:
            self.record(finding, step, judged.where)

    def _record_inputs(self, step: int, where: Where, rows: list[dict[str, Any]], ranks: list[int],
                       world_size: int, handled: bool) -> None:
        self.bad_batches = (self.bad_batches + [dict(row, step=step) for row in rows])[-BAD_BATCHES_KEPT:]
        self.record(prose.nonfinite_input(step, rows, ranks, world_size, handled), step, where,
                    key="handled" if handled else "")

    def _record_params(self, bad_params: list[tuple[str, float]], where: Where, world_size: int,
                       ranks: list[int], origin: ParamsOrigin) -> None:
        context = prose.optimizer_context(self._learning_rates, self.weights.last_grad_norm)
        self.record(prose.nonfinite_param(bad_params, origin, world_size, ranks, self.mode,
                                          self.last_finite_param_step, context), origin.label, where)

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    last_finite_param_step=self.last_finite_param_step, loss_trend=self.losses.trend.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.anomaly_count = int(state_dict.get("anomaly_count", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.weights.last_finite_step = int(state_dict.get("last_finite_param_step", -1))
        self.losses.trend.load_state_dict(state_dict.get("loss_trend", {}))

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    restored_buffer_steps=self.restored_buffer_steps,
                    mode=self.mode.value, nonfinite_inputs=list(self.bad_batches))
